"""The decode loop's `torch.compile`d functions past dynamo's recompile limit: run uncompiled, warned, from then on.

Dynamo compiles one function at most `torch._dynamo.config.recompile_limit` times a process (8 by default), and a
`fullgraph` function called with one more specialisation past that raises `FailOnRecompileLimitHit`, before running
anything. The decode loop's compiled step specialises on every shape (rows, cache length) and its compiled beam
bookkeeping on every set of rules (vocabulary, length penalty, early stopping), so a process that decodes enough
prompt lengths or beam settings meets the limit. `WithinLimit` then runs the function uncompiled for that
specialisation (its `key`), with a `CompileLimitWarning`, and keeps doing so for it: the call goes on, slower, and
says why. The first call of a specialisation is the decode loop's warm-up, outside any graph capture; a capture that
meets the limit raises (the graphed call then runs eagerly, as after any failed capture).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from torch._dynamo.exc import FailOnRecompileLimitHit

from tendril.graphs.capture import capturing

Result = TypeVar("Result")


class CompileLimitWarning(UserWarning):
    """A compiled function of the decode loop ran uncompiled: compiling it once more would pass dynamo's limit."""


class WithinLimit(Generic[Result]):
    """`compiled(*args)`, or `plain(*args)` for the specialisations (`key(*args)`) dynamo refused to compile."""

    def __init__(self, compiled: Callable[..., Result], plain: Callable[..., Result], what: str,
                 key: Callable[..., Hashable]) -> None:
        self.compiled, self.plain, self.what, self.key = compiled, plain, what, key
        self.plain_keys: set[Hashable] = set()
        """The specialisations that run uncompiled."""

    def __call__(self, *args: Any) -> Result:
        key = self.key(*args)
        if key in self.plain_keys:
            return self.plain(*args)
        try:
            return self.compiled(*args)
        except FailOnRecompileLimitHit:
            if capturing():
                raise
        self.plain_keys.add(key)
        warnings.warn(
            f"{self.what} runs uncompiled for {key}: compiling it once more would pass torch._dynamo's "
            "recompile_limit (each new shape or setting compiles anew). Raise torch._dynamo.config.recompile_limit, "
            "or use fewer shapes (pad prompts to a few lengths)", CompileLimitWarning, stacklevel=3,
        )
        return self.plain(*args)
