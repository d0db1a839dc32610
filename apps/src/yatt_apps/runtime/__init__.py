"""The runtime that hosts the jobs: launching a run on Ray, the worker classes placed on devices, the RL phases
the steps share, the async producer, warm starts, progress and Ctrl-C.

Rule of this room: it knows no job by name; a job reaches it through its declaration (`runtime.job.JobDef`).
"""
