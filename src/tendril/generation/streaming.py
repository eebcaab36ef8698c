"""Streaming tokens out of the one-launch decode loop to an HF streamer, with no per-token host sync.

Device to host: each token the loop chooses is published into a `TokenRing`, R slots of one int64 word in
host memory (on CUDA mapped page-locked memory, written by the captured graph through its device address;
on the CPU a plain tensor the eager loop writes). The k-th generated token (k = 1, 2, ...) goes to slot
(k - 1) % R as the word `k << 32 | token`, one ordinary store inside the loop body (on CUDA one small
kernel, `kernels.publish`, which also stores the device's global timer beside the word: when the token was
chosen, for measuring delivery), so it works inside the WHILE node and with every `step` (eager, compiled,
fused) and nothing on the device waits for the host.

Why one word: the counter and the token travel in one naturally aligned 8-byte store, so no order between
two stores, and no fence, is needed. What this relies on, and nothing more: (1) an int64 element is stored
by one aligned 64-bit store and the host reads it with one 64-bit load, so a word is seen whole, never half
old and half new; (2) stores into mapped memory reach the host while the kernel runs, without a sync (the
CUDA programming guide, "Mapped Memory": the memory is shared and accessed directly over the bus; only
ordering needs streams or events, and none is needed here). Slots are independent: the host never infers
anything about one slot from another. A slot's counter only grows (k, k + R, k + 2R, ...), so the host,
waiting for token k, sees an older counter (not written yet), k (the token), or a larger one (the device
lapped the host: token k is gone from the ring). The host zeroes the ring before each launch (the previous
launch has finished), so no word of an earlier call is taken for this one's. If a store arrives late or is
lapped, the token still reaches the streamer from the final tokens (below): visibility only decides how
early a token streams, never whether or in which order. On the CPU the eager loop writes an ordinary tensor
and the reader thread reads it; the interpreter's lock hand-offs order the two threads' accesses.

Beam search has no ring: which beam wins is known only at the end, so the loop publishes nothing and the
delivery thread streams the chosen sequence once the launch returns (the prompt, its tokens, `end()`).

Host side: `TokenDelivery` runs a thread that calls `streamer.put(prompt)`, then `streamer.put(tensor([token]))`
per token as HF does, polling the ring with a short sleep back-off. When the launch returns, the final
tokens are known: every token the ring did not deliver (not read yet, or lapped) is delivered from them,
in order, then `streamer.end()`. So every token arrives exactly once and in order, whatever R is. An
exception raised by the streamer stops the stream (no more `put`; `end` is attempted), is reported as a
`StreamerWarning`, and generation goes on.

Which runs publish: the loop body is also evaluated on finished states (predicated loops do that and
discard the result), so a token is published only while the loop's condition holds; otherwise the store
goes to a discard slot R. On CUDA only captured graphs publish: a graph's eager warm-up run computes the
same tokens once more, and letting it write would show the host a second copy of each counter. Eager
CUDA runs (warm-up, graph fallbacks) therefore deliver everything from the final tokens, after the run.

Like the loop's graphs and buffers, a ring serves one call at a time.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
from types import TracebackType
from typing import Any, Protocol

import torch

RING_SLOTS = 256
"""Slots of a new ring (a module attribute, so tests can force a ring smaller than the output)."""

POLL_SECONDS = (50e-6, 100e-6)
"""The reader's sleep between empty polls: starts at the first, doubles up to the second. The second bounds how
long a token that has reached host memory waits for the reader (plus the operating system's timer slack), and
is well below a decode step of the models tendril serves, so the reader wakes a few times per token at most."""

_TOKEN_BITS = 32


class Streamer(Protocol):
    """What `generate(..., streamer=...)` accepts: HF's `BaseStreamer` interface (`TextStreamer`, ...)."""

    def put(self, value: torch.Tensor) -> Any: ...

    def end(self) -> Any: ...


class StreamerWarning(UserWarning):
    """The streamer raised; streaming stopped, and generation went on."""


def check_streamable(rows: int) -> None:
    """HF's streaming limit: one sequence (a ValueError as HF raises otherwise)."""
    if rows > 1:
        raise ValueError(f"streaming supports one sequence (batch size 1, as HF's TextStreamer), got {rows} "
                         "(batch size times num_return_sequences)")


class Slot(enum.Enum):
    """What the host finds in the slot of the token it waits for."""

    READY = "ready"
    PENDING = "pending"
    LAPPED = "lapped"


class TokenRing:
    """R one-word slots written by the decode loop and read by the host (see the module docstring), and beside
    them each token's device time (`stamps`, on CUDA)."""

    def __init__(self, slots: int, device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"a token ring needs at least one slot, got {slots}")
        self.slots = slots
        if device.type == "cuda":
            from tendril.cuda.mapped import MappedHostMemory

            memory = MappedHostMemory(2 * (slots + 1) * 8, device)
            device_words, host_words = memory.device_view(torch.int64), memory.host_view(torch.int64)
        else:
            device_words = host_words = torch.zeros(2 * (slots + 1), dtype=torch.int64, device=device)
        self.words, self.stamps = device_words[: slots + 1], device_words[slots + 1 :]
        self.host_words, self.host_stamps = host_words[: slots + 1], host_words[slots + 1 :]
        self._host = host_words.numpy()
        self.reset()  # page-locked memory comes back from the allocator as it was left: a new ring holds no word
        if device.type == "cuda":
            self._load_kernel()

    def _load_kernel(self) -> None:
        """Compile and load the publishing kernel now, outside any capture (a kernel's first launch compiles
        and loads a module, which a stream capture must not see), by publishing into the discard slot."""
        from tendril.generation.kernels import publish

        one = torch.ones((), dtype=torch.long, device=self.words.device)
        publish.publish(self.words, self.stamps, torch.zeros((), dtype=torch.bool, device=self.words.device), one,
                        one.view(1), _TOKEN_BITS)

    def publish(self, live: torch.Tensor, count: torch.Tensor, token: torch.Tensor) -> None:
        """Device side: token number `count` (0-d long, from 1) is `token` ([1] long); stored only if `live` (0-d
        bool), else into the discard slot. On CUDA one kernel that also stamps the device time
        (`kernels.publish`); elsewhere PyTorch operations, and no stamp."""
        if self.words.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                from tendril.generation.kernels import publish

                publish.publish(self.words, self.stamps, live, count, token, _TOKEN_BITS)
            return
        slot = torch.where(live, (count - 1) % self.slots, self.slots)
        self.words.index_copy_(0, slot.view(1), (count << _TOKEN_BITS) + token)

    def reset(self) -> None:
        """Host side, between launches: forget every published word and stamp."""
        self._host[:] = 0

    def read(self, count: int) -> tuple[Slot, int]:
        """Host side: (READY, token) if token number `count` is in its slot, else (PENDING or LAPPED, -1)."""
        word = int(self._host[(count - 1) % self.slots])
        seen = word >> _TOKEN_BITS
        if seen == count:
            return Slot.READY, word & ((1 << _TOKEN_BITS) - 1)
        return (Slot.PENDING if seen < count else Slot.LAPPED), -1

    def stamp(self, count: int) -> int:
        """Host side, once the launch has returned: the device's global timer (ns) when token number `count` was
        published (CUDA only; 0 elsewhere, or if the token was lapped or never published)."""
        if self.read(count)[0] is not Slot.READY:
            return 0
        return int(self._host[self.slots + 1 + (count - 1) % self.slots])


class TokenDelivery:
    """The host thread that hands a ring's tokens to a streamer, as HF's `generate` would, during one launch.

    Use as a context manager around the launch; call `finish(tokens)` with the generated tokens once the
    launch has returned. Leaving the block without `finish` (generation raised) stops the thread and ends
    the stream."""

    def __init__(self, streamer: Streamer, ring: TokenRing | None, prompt: torch.Tensor) -> None:
        self.streamer = streamer
        self.ring = ring
        self.prompt = prompt.cpu()  # before the launch, outside any capture: the first `put` gets the prompt
        self.failure: Exception | None = None
        self.delivered_from_ring = 0
        self._final: list[int] | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tendril-streamer", daemon=True)

    def __enter__(self) -> TokenDelivery:
        if self.ring is not None:
            self.ring.reset()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._finished.set()
        self._thread.join()
        if self.failure is not None:
            warnings.warn(StreamerWarning(f"the streamer raised {self.failure!r}; streaming stopped, generation went "
                                          "on"), stacklevel=3)

    def finish(self, tokens: list[int]) -> None:
        """The launch returned these generated tokens: deliver what the ring has not, then end the stream."""
        self._final = tokens
        self._finished.set()

    def _run(self) -> None:
        if not self._call(self.streamer.put, self.prompt):
            return
        count = self._stream_ring()
        if self._final is not None:
            for token in self._final[count - 1 :]:
                if not self._call(self.streamer.put, torch.tensor([token])):
                    return
        self._call(self.streamer.end)

    def _stream_ring(self) -> int:
        """Hand over ring tokens until the launch returns or the ring laps; the number of the next token."""
        count, delay = 1, POLL_SECONDS[0]
        while self.ring is not None and not self._finished.is_set():
            state, token = self.ring.read(count)
            if state is Slot.LAPPED:
                break
            if state is Slot.PENDING:
                self._finished.wait(delay)
                delay = min(2 * delay, POLL_SECONDS[1])
                continue
            if not self._call(self.streamer.put, torch.tensor([token])):
                break
            count, delay = count + 1, POLL_SECONDS[0]
            self.delivered_from_ring += 1
        self._finished.wait()
        return count

    def _call(self, method: Any, *args: Any) -> bool:
        """Call the streamer; on its first exception keep it, attempt `end` and return False (stop streaming)."""
        if self.failure is not None:
            return False
        try:
            method(*args)
        except Exception as exc:  # any streamer error stops the stream, never the generation
            self.failure = exc
            if method != self.streamer.end:
                with contextlib.suppress(Exception):  # the stream is broken already; its first error is reported
                    self.streamer.end()
            return False
        return True
