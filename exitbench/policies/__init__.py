"""Exit policies: one class each, registered by name (add a policy = one class + @register)."""
from . import distribution, gate, latent, learned, reference  # noqa: F401  (registration)
from . import budget  # noqa: F401,I001  (registered after the per-token rules: it ranks a sequence's positions)
from . import conjunction  # noqa: F401,I001  (registered after the rules: it combines them)
from . import speculation  # noqa: F401,I001  (not an exit rule: the baseline the rules are compared with)
from .base import POLICY_KNOBS, REGISTRY, ExitPolicy, check_policy_name, log_probs, policy_names

__all__ = ["POLICY_KNOBS", "REGISTRY", "ExitPolicy", "check_policy_name", "log_probs", "policy_names"]
