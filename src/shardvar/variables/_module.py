"""A ShardedVariable held as a module attribute: one logical state_dict key, as ``nn.Parameter`` has.

A ShardedVariable is an ``nn.Module``, so ``module.v = variable`` registers it by torch's own
rule: ``parameters()``, ``named_parameters()`` (``v.shard_<i>``), ``.to()``, optimizers and
``del module.v`` / reassignment work as for any submodule. Its state_dict entry is the whole
logical tensor under ``v`` (the key of the unsharded ``module.v = nn.Parameter(tensor)``), loaded
from ``v`` or from the per-shard keys ``v.shard_<i>``. Only the parent can save and load ``v``:
torch hands a child only the keys under its own prefix (``v.``). So the parent gets two
state_dict hooks when a variable is first registered on it, through torch's module
registration hook.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _torch_module

from ._sharded_variable import ShardedVariable
from ._state_dict import register_logical_hooks

__all__ = ["attribute_variables"]


def attribute_variables(module: nn.Module) -> dict[str, ShardedVariable]:
    """The ShardedVariables assigned as attributes of ``module`` itself, by attribute name."""
    return {n: v for n, v in module._modules.items() if isinstance(v, ShardedVariable)}


def _shard_keys(name: str, variable: ShardedVariable) -> dict[int, str]:
    return {s: f"{name}.shard_{s}" for s in variable.local_shards()}


def _attribute_state(module: nn.Module) -> tuple[str, None, dict]:
    """The attribute variables of ``module`` for the logical state_dict hooks (each keeps its own form)."""
    return "logical", None, {n: (v, _shard_keys(n, v)) for n, v in attribute_variables(module).items()}


def _on_register(module: nn.Module, name: str, value: object) -> None:
    if isinstance(value, ShardedVariable) and "_shardvar_attribute_hooks" not in module.__dict__:
        module.__dict__["_shardvar_attribute_hooks"] = True
        register_logical_hooks(module, _attribute_state)


# Global, because torch offers no per-class hook for "a module was assigned to me"; it is torch's
# own extension point for this (called from nn.Module.__setattr__ and add_module), costs one
# isinstance per registration, returns None (the value is registered unchanged), and is
# registered once per process (a reload of this module finds its earlier hook and adds none).
def _installed() -> bool:
    hooks = _torch_module._global_module_registration_hooks.values()
    return any(getattr(h, "__module__", None) == __name__ and h.__name__ == "_on_register" for h in hooks)


if not _installed():
    _torch_module.register_module_module_registration_hook(_on_register)
