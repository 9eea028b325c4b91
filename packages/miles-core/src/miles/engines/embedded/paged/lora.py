"""LoRA adapters on the paged path: preallocated slots, applied per token, CUDA-graph safe.

The DynamicCache path (:class:`~miles.engines.embedded.lora.LoraServing`) applies each adapter
to its rows with a hook per adapter that picks the rows on the host (``index_add``). A decode
step of the paged path is a CUDA graph: its shapes are fixed when it is captured and it may not
read anything on the host. So here every adapter lives in one of ``max_loras`` *slots*, and one
forward hook per target linear applies every slot at once, per token:

- per target module, two stacked device tensors hold every slot's factors, padded to
  ``max_rank``: ``A [S, R, in]`` and ``B [S, R, out]`` (an adapter of rank ``r`` in slot ``s``
  owns ``A[s - 1, :r]`` and ``B[s - 1, :r]``; the rest stays zero, so padding adds exact zeros);
- slot 0 means "no adapter"; each request's table row has a slot in the runner's device table
  ``lora_rows`` (like its temperature), written when the request is admitted;
- around a forward the runner gives the slot of every token (:meth:`PagedLoraServing.tokens`);
  from it one ``[tokens, S]`` coefficient matrix is made, ``scale[s]`` in the column of the
  token's slot and 0 elsewhere (``torch.where``, so exact zeros);
- a hook then adds ``((x @ A_all^T) * coef) @ B_all`` to the linear's output: one GEMM against
  every slot's A (``[tokens, S * R]``), the coefficients zero every column but the token's own
  slot's, one GEMM against every slot's B. Static shapes, no host read; a base token (slot 0)
  gets exactly ``output + 0``.

The cost of a step with adapters is two GEMMs of width ``S * R`` per adapted linear, whatever
adapters its rows use, so ``max_loras`` and ``max_rank`` are kept small (engine options; an
adapter beyond them is refused at load with one error naming the option). A step none of
whose rows uses an adapter runs no LoRA op when it runs eagerly (prefill, the CPU); the decode
graphs, captured once while adapters are loaded, run the hooks for every step (base rows
getting zeros).

The factors the :class:`~miles.engines.embedded.weights.WeightUpdater` writes are views into
the stacks (``A[s - 1, :r]`` and ``B[s - 1, :r].T``), registered under the usual names
(``<module>.lora_A.<adapter>.weight``): every weight-update path copies into them in place, so
an update lands between two steps, graphs included, and the weight checker digests what is
served. Loading or unloading never moves a stack while it exists: graphs are captured again
only when the set of adapted modules changes (the first adapter of a module allocates its
stacks; the last adapter's unload frees them all, so an engine without adapters runs exactly
as before).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from miles.engines.embedded.lora import Adapter, LoraError, LoraServing


def served_modules(model: Any) -> set[str]:
    """Names of the linears the paged forward calls as modules, so their forward hooks fire
    (attention projections, dense MLP projections, ``lm_head``); only these can be adapted."""
    from miles.engines.embedded.paged.moe import is_sparse

    names = {id(mod): name for name, mod in model.named_modules()}
    called: list[Any] = [model.get_output_embeddings()]
    for layer in model.model.layers:
        attn = layer.self_attn
        called += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if not is_sparse(layer.mlp):
            called += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    return {names[id(m)] for m in called if isinstance(m, nn.Linear) and id(m) in names}


class PagedLoraServing(LoraServing):
    """Adapters in ``max_loras`` slots of rank at most ``max_rank``; see the module doc.

    ``in_use(name)`` counts the requests running or queued with an adapter (an adapter in use is
    not unloaded); ``on_adapter(name)`` is called when an adapter's factors are replaced or
    dropped (its cached KV must go); ``on_layout()`` when stacks were allocated or freed (the
    decode graphs read their addresses). All three run under the step lock.
    """

    def __init__(
        self,
        model: nn.Module,
        updater: Any,
        step_lock: Any,
        *,
        max_loras: int,
        max_rank: int,
        in_use: Callable[[str], int],
        on_adapter: Callable[[str], object],
        on_layout: Callable[[], object],
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        super().__init__(model, updater, step_lock)
        self.max_loras = int(max_loras)
        self.max_rank = int(max_rank)
        self.servable = served_modules(model)
        self._in_use = in_use
        self._on_adapter = on_adapter
        self._on_layout = on_layout
        self.slots: dict[str, int] = {}  # adapter name -> slot (1..max_loras)
        # module path -> (A [S, R, in], B [S, R, out]); slot s owns index s - 1.
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scales = torch.zeros(self.max_loras, dtype=self.dtype, device=self.device)
        self._slot_ids = torch.arange(1, self.max_loras + 1, device=self.device)
        # Set around one forward: [tokens or rows, S] coefficients (None: no LoRA in this forward),
        # those of the tokens lm_head sees, and whether they are per row of a [B, L] batch.
        self._coef: torch.Tensor | None = None
        self._head_coef: torch.Tensor | None = None
        self._per_row = False
        self._head = cast("Any", model).get_output_embeddings()  # (an HF causal LM)

    # ---------------------------------------------------------------- loading

    def _install(self, adapter: Adapter) -> None:
        """Put ``adapter`` in a slot (its own if the name is loaded already). Every check comes
        first: a refused adapter leaves the engine unchanged."""
        name = adapter.name
        if adapter.rank > self.max_rank:
            raise LoraError(
                f"adapter {adapter.path!r} has rank {adapter.rank}; this engine's adapter slots hold rank <= "
                f"{self.max_rank} (start the engine with a larger --max-lora-rank)"
            )
        outside = sorted(set(adapter.factors) - self.servable)
        if outside:
            raise LoraError(
                f"adapter {adapter.path!r} adapts {outside[:3]}, which the paged path does not run as linear "
                "modules (it serves attention and dense MLP projections and lm_head); use --kv-cache dynamic"
            )
        slot = self.slots.get(name)
        if slot is None:
            used = set(self.slots.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:
                raise LoraError(
                    f"no free adapter slot for {name!r}: all {self.max_loras} slots hold adapters "
                    f"({', '.join(sorted(self.slots))}); unload one, or start the engine with a larger "
                    "--max-loras"
                )
            slot = free[0]
        new = [m for m in sorted(adapter.factors) if m not in self.stacks]
        allocated = {m: self._allocate(m) for m in new}  # (may run out of memory: nothing changed yet)
        self.stacks.update(allocated)
        old = self.adapters.get(name)
        if old is not None:
            self.updater.remove_tensors(list(old.tensors()))
        with torch.no_grad():
            self._clear(slot)
            for module, (a, b) in list(adapter.factors.items()):
                stack_a, stack_b = self.stacks[module]
                view_a = stack_a[slot - 1, : adapter.rank]  # [r, in]
                view_b = stack_b[slot - 1, : adapter.rank].t()  # [out, r]
                view_a.copy_(a)
                view_b.copy_(b)
                adapter.factors[module] = (view_a, view_b)
            self.scales[slot - 1] = adapter.scale
        self.adapters[name] = adapter
        self.slots[name] = slot
        self.updater.add_tensors(adapter.tensors())
        for module in new:
            head = self.linears[module] is self._head
            self._hooks[module] = self.linears[module].register_forward_hook(self._slot_hook(module, head))
        self._on_adapter(name)
        if new:
            self._on_layout()

    def _allocate(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        linear = self.linears[module]
        shape = (self.max_loras, self.max_rank)
        return (
            torch.zeros(*shape, linear.in_features, dtype=self.dtype, device=self.device),
            torch.zeros(*shape, linear.out_features, dtype=self.dtype, device=self.device),
        )

    def _clear(self, slot: int) -> None:
        """Zero ``slot`` in every stack (a slot's padding and unused modules must add nothing)."""
        for a, b in self.stacks.values():
            a[slot - 1].zero_()
            b[slot - 1].zero_()
        self.scales[slot - 1] = 0.0

    def unload(self, name: str) -> None:
        """Forget adapter ``name``; refused while requests use it. The last adapter's unload frees
        every stack and hook."""
        with self.updater.lock, self.step_lock:
            if name not in self.adapters:
                raise LoraError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self.adapters)})")
            users = self._in_use(name)
            if users:
                raise LoraError(
                    f"LoRA adapter {name!r} is used by {users} running or queued request(s); abort them or "
                    "wait for them to finish before unloading it"
                )
            adapter = self.adapters.pop(name)
            slot = self.slots.pop(name)
            self.updater.remove_tensors(list(adapter.tensors()))
            with torch.no_grad():
                self._clear(slot)
            self._on_adapter(name)
            if not self.adapters:
                for hook in self._hooks.values():
                    hook.remove()
                self._hooks.clear()
                self.stacks.clear()
                self._on_layout()

    def slot(self, name: str | None) -> int | None:
        """The slot of a request's adapter: 0 for the base, None when ``name`` is not loaded."""
        return 0 if name is None else self.slots.get(name)

    def describe(self) -> list[dict[str, Any]]:
        rows = super().describe()
        for row in rows:
            row["slot"] = self.slots[row["name"]]
        return rows

    def slots_info(self) -> dict[str, Any]:
        """The slots' shape and memory, for ``/get_server_info``."""
        return {
            "max_loras": self.max_loras,
            "max_rank": self.max_rank,
            "free": self.max_loras - len(self.slots),
            "modules": len(self.stacks),
            "bytes": sum(a.nbytes + b.nbytes for a, b in self.stacks.values()),
        }

    # ---------------------------------------------------------------- serving

    @contextlib.contextmanager
    def tokens(self, slots: torch.Tensor, logit_rows: torch.Tensor | None = None) -> Iterator[None]:
        """Apply slot ``slots[i]``'s adapter (0: none) to token ``i`` of the paged forwards inside the
        block; ``lm_head`` sees the tokens ``logit_rows`` (None: all). Device tensors only: it is
        what a decode graph records."""
        coef = torch.where(slots[:, None] == self._slot_ids, self.scales, 0.0)
        self._coef = coef
        self._head_coef = coef if logit_rows is None else coef[logit_rows]
        self._per_row = False
        try:
            yield
        finally:
            self._coef = self._head_coef = None

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Apply ``names[i]``'s adapter to row ``i`` of a ``[B, L]`` HF forward (the DynamicCache
        runner scoring requests on the paged engine)."""
        slots: list[int] = []
        for name in names:
            slot = self.slot(name)
            if slot is None:  # unloaded while queued: fail the step, naming it
                raise LoraError(f"LoRA adapter {name!r} was unloaded")
            slots.append(slot)
        with self.tokens(torch.tensor(slots, dtype=torch.long, device=self.device)):
            self._per_row = True
            yield

    def _slot_hook(self, module: str, head: bool) -> Any:
        def hook(
            _mod: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor | None:
            coef = self._head_coef if head else self._coef
            if coef is None:
                return None
            a, b = self.stacks[module]
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            n = flat.shape[0]
            if coef.shape[0] != n:
                if not self._per_row or n % coef.shape[0]:
                    raise RuntimeError(
                        f"LoRA: {n} tokens reach {module}, but {coef.shape[0]} were given slots"
                    )
                rows, width = coef.shape
                coef = coef[:, None, :].expand(rows, n // rows, width).reshape(n, width)  # [B] -> [B * L]
            s, r = a.shape[0], a.shape[1]
            down = nn.functional.linear(flat, a.view(s * r, -1)).view(n, s, r) * coef[:, :, None]
            delta = torch.mm(down.view(n, s * r), b.view(s * r, -1))
            return output + delta.view(output.shape)

        return hook
