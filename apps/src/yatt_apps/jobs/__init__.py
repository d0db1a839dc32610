"""The jobs: one module per job (`grpo`, `dapo`, `ppo`, `capo`, `vlm`, `sft`, and Bone Soup `merge`).

Rule of this room: a job module holds its step function and its declaration; it calls the runtime's shared
phases and never starts Ray or parses arguments itself.
"""
