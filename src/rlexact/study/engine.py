"""A controlled, engine-level training-inference mismatch: the rollout runs a lower-precision copy of the weights.

:class:`rlexact.callbacks.MismatchInjection` perturbs the *reported* rollout log-probs only; the tokens are still
sampled from the trainer's distribution. That cannot reproduce the main effect the paper studies, a policy gradient
computed by the trainer on samples drawn from a *different* distribution (the rollout engine's). A real non-exact
engine differs in its kernels; :class:`PerturbedRolloutModule` makes the difference controllable instead: its
generator runs on a second copy of the model whose weights are those of the policy after a deterministic
perturbation (:func:`perturb_weight`), re-synchronized after every optimizer step, with the exact kernels. So:

- the samples, and the log-probs the generator reports, come from ``mu = pi_{q(theta)}``;
- the trainer computes ``pi_theta`` (``old_logprob_mode="recompute"``: pi_old = the trainer's; ``"bypass"``:
  pi_old = ``mu``);
- the strength is a knob: ``"bf16"`` / ``"fp16"`` (round every weight; a mixed-precision rollout), ``"fp8_e4m3"`` /
  ``"fp8_e5m2"`` (per-tensor scaled FP8 of the linear layers' weights, the LM head excluded, as FP8 rollout stacks
  do) or ``"noise"`` (each linear weight times ``1 + scale * z`` with ``z ~ N(0, 1)`` fixed per element, keyed by
  the seed and the parameter's name).

Everything else (sampler keys, batch composition, scheduling) is the exact engine's, so the arms differ only by the
rollout weights. Evaluations through :meth:`generate` sample from the rollout engine, i.e. they score the policy as
it is deployed.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from rlexact.distributed import is_fsdp
from rlexact.models import exactify
from rlexact.module import RLModule

__all__ = [
    "WEIGHT_PERTURBATIONS",
    "PerturbedCopy",
    "PerturbedRolloutModule",
    "perturb_weight",
    "perturbed_parameter_names",
]

WeightPerturbation = Literal["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "noise"]
WEIGHT_PERTURBATIONS: tuple[str, ...] = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "noise")

_ROUND = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def perturb_weight(weight: torch.Tensor, kind: str, noise: torch.Tensor | None = None) -> torch.Tensor:
    """A new tensor of ``weight``'s dtype and device: ``weight`` as a lower-precision or noisy engine would hold it.

    - ``"bf16"`` / ``"fp16"``: round to that dtype and back;
    - ``"fp8_e4m3"`` / ``"fp8_e5m2"``: per-tensor scale to the format's maximum (``amax`` maps to it), round to FP8,
      unscale (an all-zero tensor stays zero);
    - ``"noise"``: ``weight * (1 + noise)`` with the given ``noise`` (same shape; already scaled).
    """
    w = weight.detach()
    if kind in _ROUND:
        return w.to(_ROUND[kind]).to(w.dtype)
    if kind in _FP8:
        fmt = _FP8[kind]
        x = w.float()
        if not x.numel():
            return w.clone()
        amax = x.abs().amax().double()  # on the device: no host round trip per tensor
        scale = torch.where(amax > 0, torch.finfo(fmt).max / amax, 1.0)  # float64, as a Python float would be
        return ((x * scale).to(fmt).float() / scale).to(w.dtype)
    if kind == "noise":
        if noise is None or noise.shape != w.shape:
            raise ValueError(f"'noise' perturbation needs a noise tensor of shape {tuple(w.shape)}")
        return (w.float() * (1.0 + noise.to(w.device, torch.float32))).to(w.dtype)
    raise ValueError(f"unknown weight perturbation {kind!r}; expected one of {WEIGHT_PERTURBATIONS}")


def perturbed_parameter_names(model: nn.Module, kind: str) -> set[str]:
    """Parameters the perturbation touches: every floating parameter for ``bf16`` / ``fp16``; for FP8 and noise, the
    weights of ``nn.Linear`` layers except the output embedding (LM head), whose parameter is skipped even when it is
    tied to the input embedding."""
    if kind in _ROUND:
        return {name for name, p in model.named_parameters() if p.is_floating_point()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(head.weight)} if head is not None else set()
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) not in skip:
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


class PerturbedCopy:
    """A second instance of a model's architecture holding ``q(theta)``, the perturbed weights of ``model``.

    Built on first :meth:`sync` (same config, dtype and device, exactified, eval mode, no grad); :meth:`sync` copies
    the perturbed current weights in (parameters outside :func:`perturbed_parameter_names` are copied unchanged).

    Attributes:
        weight_rel_diff: ``||q(theta) - theta|| / ||theta||`` over the perturbed parameters at the last sync.
    """

    def __init__(self, model: nn.Module, kind: str, scale: float = 0.0, seed: int = 0) -> None:
        if kind not in WEIGHT_PERTURBATIONS:
            raise ValueError(f"unknown weight perturbation {kind!r}; expected one of {WEIGHT_PERTURBATIONS}")
        if kind == "noise" and not (0.0 < scale < float("inf")):
            raise ValueError(f"the 'noise' perturbation needs a finite scale > 0, got {scale}")
        if is_fsdp(model):
            raise RuntimeError("a perturbed copy holds the full weights: run it without FSDP")
        self.source = model
        self.kind = kind
        self.scale = float(scale)
        self.seed = int(seed)
        self.model: nn.Module | None = None
        self.weight_rel_diff = 0.0
        self._noise: dict[str, torch.Tensor] = {}
        self._names: set[str] = set()  # perturbed_parameter_names of the source, found when the copy is built

    @torch.no_grad()
    def sync(self) -> nn.Module:
        """Write ``q(theta)`` of the source's current weights into the copy; returns the copy."""
        if self.model is None:
            self.model = self._build()
            self._names = perturbed_parameter_names(self.source, self.kind)
        names = self._names
        target = dict(self.model.named_parameters())
        diffs: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        for index, (name, p) in enumerate(self.source.named_parameters()):
            if name not in names:
                target[name].copy_(p.detach())
                continue
            q = perturb_weight(p, self.kind, self._noise_for(name, index, p) if self.kind == "noise" else None)
            target[name].copy_(q)
            diffs.append((q.double() - p.double()).pow(2).sum())
            norms.append(p.double().pow(2).sum())
        if diffs:  # one host read per sync
            diff2, norm2 = (float(v) for v in torch.stack([torch.stack(diffs).sum(), torch.stack(norms).sum()]))
        else:
            diff2, norm2 = 0.0, 0.0
        self.weight_rel_diff = (diff2 / norm2) ** 0.5 if norm2 > 0 else 0.0
        return self.model

    def _noise_for(self, name: str, index: int, p: torch.Tensor) -> torch.Tensor:
        """The fixed relative noise of parameter ``index`` (drawn once, on CPU, from ``(seed, index)``)."""
        if name not in self._noise:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(self.seed * 1_000_003 + index)
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            self._noise[name] = (self.scale * z).to(p.device)
        return self._noise[name]

    def _build(self) -> nn.Module:
        src = self.source
        with torch.random.fork_rng(devices=[]):
            copy = type(src)(src.config)
        ref = dict(src.named_parameters())
        for name, p in copy.named_parameters():
            p.data = ref[name].detach().clone()
        device = next(src.parameters()).device
        for mod in copy.modules():  # buffers (rotary tables) keep their fp32 values and follow the device
            for b_name, b in list(mod.named_buffers(recurse=False)):
                setattr(mod, b_name, b.to(device))
        copy.requires_grad_(False)
        copy.eval()
        return exactify(copy)


class PerturbedRolloutModule(RLModule):
    """:class:`rlexact.RLModule` whose generator samples from a perturbed copy of the policy's weights.

    Args:
        rollout_weights: the perturbation (see the module docstring); ``None`` = the plain RLModule behaviour.
        rollout_weight_scale: standard deviation of the ``"noise"`` perturbation (relative), ignored otherwise.
        rollout_weight_seed: seed of the ``"noise"`` draws.
        *args, **kwargs: :class:`rlexact.RLModule` arguments. With a perturbation, ``old_logprob_mode`` must be
            ``"recompute"`` or ``"bypass"`` (the rollout log-probs are not the trainer's).

    The copy is re-synchronized whenever the generator is used after an optimizer step (``trainer.global_step``
    changed), or on every use outside a trainer.
    """

    def __init__(
        self,
        *args: Any,
        rollout_weights: WeightPerturbation | None = None,
        rollout_weight_scale: float = 0.0,
        rollout_weight_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if rollout_weights is not None and rollout_weights not in WEIGHT_PERTURBATIONS:
            raise ValueError(f"rollout_weights must be one of {WEIGHT_PERTURBATIONS} or None, got {rollout_weights!r}")
        if rollout_weights is not None and self.algo.old_logprob_mode == "exact":
            raise ValueError(
                "a perturbed rollout engine reports log-probs that are not the trainer's: set "
                "algorithm.old_logprob_mode to 'recompute' or 'bypass'"
            )
        if rollout_weights == "noise" and not (0.0 < rollout_weight_scale < float("inf")):
            raise ValueError(f"rollout_weights='noise' needs a finite scale > 0, got {rollout_weight_scale}")
        self.rollout_weights = rollout_weights
        self.rollout_weight_scale = float(rollout_weight_scale)
        self.rollout_weight_seed = int(rollout_weight_seed)
        self.__dict__["_rollout_copy"] = None
        self.__dict__["_rollout_generator"] = None
        self._synced_at: int | None = None

    @property
    def exact_rollout(self) -> bool:
        """False with a perturbation: the generator then samples and reports the perturbed copy's log-probs."""
        return self.rollout_weights is None and super().exact_rollout

    @property
    def rollout_copy(self) -> PerturbedCopy | None:
        """The perturbed copy the generator runs on (``None`` without a perturbation or before first use)."""
        return self.__dict__.get("_rollout_copy")

    @property
    def generator(self) -> Any:
        """The generator of the rollout engine: on the perturbed copy, synchronized with the current weights."""
        if self.rollout_weights is None:
            return super().generator
        if self.model is None:
            raise RuntimeError("the model is not built yet: call configure_model() (Lightning does it in fit)")
        copy = self.rollout_copy
        if copy is None:
            copy = PerturbedCopy(self.model, self.rollout_weights, self.rollout_weight_scale, self.rollout_weight_seed)
            self.__dict__["_rollout_copy"] = copy
        version = int(self.trainer.global_step) if self._trainer is not None else None
        if copy.model is None or version is None or version != self._synced_at:
            copy.sync()
            self._synced_at = version
        if self.__dict__["_rollout_generator"] is None:
            from rlexact.rollout import Generator

            self.__dict__["_rollout_generator"] = Generator(
                copy.model, kernels=self.rollout_cfg.kernels, **self.rollout_cfg.generator
            )
        return self.__dict__["_rollout_generator"]
