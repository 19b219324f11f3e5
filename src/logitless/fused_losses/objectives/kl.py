"""KL estimators between the policy and a reference, per token (Schulman's k1/k2/k3)."""

import torch

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+"}


def kl_estimate(lp: torch.Tensor, ref_lp: torch.Tensor, estimator: str, clamp: bool = False):
    """Per-token KL estimate with ``x = ref_lp - lp``.

    ``k1 = -x``, ``k2 = x^2 / 2``, ``k3 = exp(x) - x - 1``, ``abs = |x|``. A trailing ``+``
    keeps the value and takes the gradient of k2 (straight-through; k2's gradient is the
    unbiased gradient of KL(pi || ref)). ``clamp`` is verl's k3 guard: x to [-20, 20] and the
    result to [-10, 10]. Gradient flows to ``lp``.
    """
    estimator = _ALIASES.get(estimator, estimator)
    straight_through = estimator.endswith("+")
    base = estimator.rstrip("+")
    x = ref_lp - lp
    if base == "k1":
        value = -x
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "abs":
        value = x.abs()
    elif base == "k3":
        if clamp:
            xc = x.clamp(-20.0, 20.0)
            value = (torch.exp(xc) - xc - 1).clamp(-10.0, 10.0)
        else:
            value = torch.exp(x) - x - 1
    else:
        raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")
    if not straight_through or base == "k2":
        return value
    k2 = 0.5 * x.square()
    return k2 - k2.detach() + value.detach()


def kl_in_reward(rewards: torch.Tensor, lp: torch.Tensor, ref_lp: torch.Tensor, beta, mask):
    """Token rewards with the k1 penalty folded in: ``r_t - beta m_t (lp_t - ref_t)``, no grad."""
    return rewards - beta * (lp - ref_lp).detach() * mask
