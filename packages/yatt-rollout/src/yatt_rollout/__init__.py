"""yatt-rollout: one generation interface over HF transformers and vLLM.

Requests, completions, media references and weight buckets (`yatt_rollout.types`); engines live in modules
that import torch, transformers or vllm only when used. Importing this package loads msgspec only.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-rollout")
