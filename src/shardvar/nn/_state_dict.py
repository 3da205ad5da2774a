"""The logical state_dict form (its one implementation lives in ``variables._state_dict``)."""

from ..variables import FORMS, check_not_assign, load_logical, register_logical_hooks, reorder, save_logical

__all__ = ["FORMS", "save_logical", "load_logical", "reorder", "check_not_assign", "register_logical_hooks"]
