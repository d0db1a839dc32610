"""The `yatt` command (`cli.main`), `yatt doctor` and the commented config of `yatt config`.

Rule of this room: parse arguments, call the other rooms, map errors to exit codes; no job logic here.
"""
