def convert(*a, **k): raise NotImplementedError
