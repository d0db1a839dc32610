"""yatt-algos: the RL math and the learner.

Advantage estimators, policy and value losses, KL, loss aggregation, filters, CAPO credit and Bone Soup, as
pure functions on torch tensors; the policy and critic learners. `import yatt_algos` loads msgspec only;
the math modules import torch.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-algos")
