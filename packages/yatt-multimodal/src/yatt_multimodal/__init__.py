"""yatt-multimodal: rewards for language and vision-language RL.

Rule rewards, discriminative reward models, generative judges (GenRM, CAPO's GenPRM) run through a
yatt-rollout engine, and media inputs. Importing this package loads msgspec only.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-multimodal")
