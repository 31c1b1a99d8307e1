"""Exit policies: one class each, registered by name (add a policy = one class + @register)."""
from . import distribution, latent, reference  # noqa: F401  (registration)
from .base import REGISTRY, ExitPolicy, make_policy, policy_names

__all__ = ["REGISTRY", "ExitPolicy", "make_policy", "policy_names"]
