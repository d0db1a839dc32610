"""Files in and out: the run folder, dataset and record readers, model folders (built, fetched, exported).

Rule of this room: no Ray and no training; functions here read or write files and name the file, row and field
of anything malformed.
"""
