"""Objects that own this process's pages, threads and files: they are never copied or pickled.

A copy of a manager, a cache or a ``PrefixCache`` would share their page tables with the
original while each believed it owned them (closing one would leave the other pointing at freed
pages), and a pickled one could not bring its memory, threads or locked files along. So
``copy.copy``, ``copy.deepcopy`` and ``pickle`` all raise ``TypeError`` naming the class and what
to do instead (``remedy``).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn


class ProcessBound:
    """Refuses ``copy``, ``deepcopy`` and ``pickle`` with a ``TypeError`` that ends with ``remedy``."""

    __slots__ = ()
    remedy: ClassVar[str]

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} cannot be copied or pickled: it owns this process's pages, "
            f"threads and files; {self.remedy}"
        )
