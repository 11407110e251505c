"""The addresses the Triton interpreter's masked loads read while a call runs (for tests that count what a
kernel reads, e.g. each K/V element once per kv head, or exactly the block-table entries in use)."""
import numpy as np


def loads_during(monkeypatch, run) -> np.ndarray:
    """Every address (int64, in load order, repeats kept) a masked load read during ``run()``."""
    from triton.runtime import interpreter

    reads = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def counted(self, ptrs, mask, other, *a):
        addr = ptrs.data[mask.data.astype(bool)] if mask is not None else ptrs.data.ravel()
        reads.append(addr.ravel().copy())
        return load(self, ptrs, mask, other, *a)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)
    try:
        run()
    finally:
        monkeypatch.undo()
    return np.concatenate(reads).astype(np.int64) if reads else np.zeros(0, np.int64)


def entries_read(addr: np.ndarray, table) -> set:
    """The (row, column) entries of a 2-D ``table`` among the addresses ``addr``."""
    base, size = table.data_ptr(), table.element_size()
    flat = (np.unique(addr[(addr >= base) & (addr < base + table.numel() * size)]) - base) // size
    return {(int(i) // table.shape[1], int(i) % table.shape[1]) for i in flat}
