"""Zero-copy graph inputs, an optional plug-in of `GraphedCallable`: the op that produces a graph's input
writes it straight into the placeholder the graph reads.

Two ways in, both on the callable: `with fast.zero_copy():` learns which ops produce the next call's
inputs and redirects them into placeholders (Grape's alias predictor, made safe: verified at every call,
a wrong prediction costs a copy, never a wrong value); `fast.carry(output=..., input=...)` declares
loop-carried state that each graph writes where the next call reads it. The first use of either makes the
callable's `plugin.ZeroCopy`; a callable that uses neither never imports this package.

Modules, by job:

- `lanes`: placeholder lanes (redirected inputs live beside the copied ones) and `LaneKey`;
- `ops`: what the predictor knows of an op (producer, `out=` form, signature, what it reads);
- `predictor`: learning, redirecting and verifying (`ZeroCopyPredictor`);
- `mode`: the `TorchFunctionMode` that routes a block's torch calls to the predictor;
- `carry`: loop-carried state (`CarryPlan`);
- `plugin`: `ZeroCopy`, the hooks the dispatcher calls.

A key can have up to three graphs (lanes 0, 1, 2), captured lazily as calls need them; they share the
callable's pool, but each has its own driver memory. Bucketed calls are padded into fresh tensors, so
zero-copy helps unbucketed callables only.
"""
