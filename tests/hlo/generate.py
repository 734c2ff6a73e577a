"""Writes the corpus of compiled HLO texts that `tests/test_hlo.py` reads.

Run it with the Python of the JAX to compile with (it imports only JAX and NumPy,
not eqshard):

    python tests/hlo/generate.py --target cpu        # XLA:CPU, 8 simulated devices
    python tests/hlo/generate.py --target tpu        # XLA:TPU through libtpu: v5e 2x4

Each program is compiled on a mesh of 2 x 4 devices `("data", "model")` and
written as `<folder>/<program>.hlo` (`compiled.as_text()`), with
`<program>.json`: the collectives one run moves, each as kind, bytes per device,
count and device groups, and the FLOPs of the matrix products one device runs.
Those expectations are written here by hand from each program's shapes and
shardings, never by reading the text: the test compares eqshard's reading of the
text against them. Where a compiler chooses how to run a program (XLA:CPU widens
an 8-bit float to 16 bits before gathering it; XLA:TPU runs a reduce-scatter as
its all-reduce-scatter fusion), the expectation says which compiler chose what.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
DATA, MODEL = 2, 4  # the mesh
F32 = 4  # bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--target", choices=("cpu", "tpu"), required=True)
    parser.add_argument("--out", type=Path, help="the folder (default: one per target here)")
    parser.add_argument("--only", nargs="*", help="programs to write (default: all)")
    args = parser.parse_args()
    if args.target == "tpu":
        os.environ["TPU_SKIP_MDS_QUERY"] = "1"
    import jax

    if args.target == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    context = Context(args.target)
    out = args.out or HERE / context.folder
    out.mkdir(parents=True, exist_ok=True)
    for name, program in PROGRAMS.items():
        if args.only and name not in args.only:
            continue
        if args.target not in program.targets:
            continue
        compiled, expected = program.write(context)
        text = compiled.as_text()
        costs = compiled.cost_analysis()
        costs = costs[0] if isinstance(costs, list) else costs
        expected = {
            "program": name,
            "target": context.target_name,
            "versions": context.versions,
            "mesh": {"data": DATA, "model": MODEL},
            **expected,
            "xla_flops": float(costs.get("flops", 0.0)) if costs else None,
        }
        (out / f"{name}.hlo").write_text(text)
        (out / f"{name}.json").write_text(json.dumps(expected, indent=1) + "\n")
        print(f"{out.name}/{name}: {len(text):,} characters", file=sys.stderr)
    return 0


class Context:
    """The target: its devices as a 2 x 4 mesh, and how to name it."""

    def __init__(self, target: str) -> None:
        import jax
        import numpy as np
        from jax.sharding import Mesh

        self.target = target
        if target == "tpu":
            from jax.experimental import topologies

            devices = topologies.get_topology_desc(topology_name="v5e:2x4", platform="tpu").devices
            from importlib.metadata import version

            self.versions = {"jax": jax.__version__, "libtpu": version("libtpu")}
            self.target_name = "XLA:TPU v5e 2x4 (libtpu, compiled on a CPU host)"
            self.folder = f"tpu-jax{jax.__version__}"
        else:
            devices = jax.devices()[:8]
            self.versions = {"jax": jax.__version__}
            self.target_name = "XLA:CPU, 8 simulated devices"
            self.folder = f"cpu-jax{jax.__version__}"
        self.mesh = Mesh(np.array(devices).reshape(DATA, MODEL), ("data", "model"))

    def sds(self, shape, spec, dtype="float32"):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self.mesh, PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def sharding(self, *spec):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def shard_map(self, f, in_specs, out_specs):
        """`jax.shard_map` on the mesh: specs as tuples (a list of them for several
        outputs)."""
        import jax
        from jax.sharding import PartitionSpec as P

        outs = tuple(P(*s) for s in out_specs) if isinstance(out_specs, list) else P(*out_specs)
        return jax.shard_map(
            f,
            mesh=self.mesh,
            in_specs=tuple(P(*s) for s in in_specs),
            out_specs=outs,
            check_vma=False,
        )


# Expectations, by hand --------------------------------------------------------


def device(data: int, model: int) -> int:
    """The device id of a mesh position: row-major over (data, model)."""
    return data * MODEL + model


def groups(*axes: str) -> list[list[int]]:
    """The device groups of a collective over `axes`: the devices that differ
    from each other along those axes only."""
    found: dict[tuple[int, ...], list[int]] = {}
    for d in range(DATA):
        for m in range(MODEL):
            key = (() if "data" in axes else (d,)) + (() if "model" in axes else (m,))
            found.setdefault(key, []).append(device(d, m))
    return list(found.values())


def collective(kind: str, nbytes: int, over: list[list[int]], count: int = 1) -> dict:
    return {"kind": kind, "bytes": nbytes, "count": count, "groups": over}


class Program:
    """A program of the corpus: `write(context)` compiles it and says what it
    expects."""

    targets = ("cpu", "tpu")

    def write(self, c: Context):
        raise NotImplementedError


class Collectives(Program):
    """Every kind by hand, in `shard_map`: a reduce-scatter, an all-gather and an
    all-to-all over `model`, a collective-permute and an all-reduce over `data`,
    and a product of another array beside them, for XLA:TPU to overlap them with:
    there (with async all-to-all on) the all-to-all and the permute are async
    `-start`/`-done` pairs."""

    ROWS, COLUMNS, SQUARE = 256, 512, 256

    def write(self, c):
        import jax
        import jax.numpy as jnp

        def body(x, y):
            a = jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True)
            b = jax.lax.all_gather(a * 2, "model", axis=0, tiled=True)
            e = jax.lax.ppermute(b, "data", perm=[(0, 1), (1, 0)])
            d = jax.lax.all_to_all(x, "model", 0, 1, tiled=True)  # beside the product
            product = jnp.dot(jnp.dot(y, y, precision="highest"), y, precision="highest")
            return jax.lax.psum(e * 3, "data"), d * 5, product

        f = c.shard_map(body, in_specs=[(), ()], out_specs=[(), ("model",), ()])
        options: dict[str, str | bool] = {}
        if c.target == "tpu":  # so that the all-to-all is async: it runs beside the product
            options["xla_tpu_enable_async_all_to_all"] = True
        x = c.sds((self.ROWS, self.COLUMNS), ())
        y = c.sds((self.SQUARE, self.SQUARE), ())
        compiled = jax.jit(f).lower(x, y).compile(compiler_options=options)
        whole = self.ROWS * self.COLUMNS * F32  # every step moves one whole array
        pairs = [[device(0, m), device(1, m)] for m in range(MODEL)]
        pairs += [[device(1, m), device(0, m)] for m in range(MODEL)]
        return compiled, {
            "collectives": [
                collective("reduce-scatter", whole, groups("model")),  # its operand
                collective("all-gather", whole, groups("model")),  # its result
                collective("all-to-all", whole, groups("model")),
                collective("collective-permute", whole, pairs),
                collective("all-reduce", whole, groups("data")),
            ],
            "flops": 2 * 2 * self.SQUARE**3,
        }


class Fsdp(Program):
    """FSDP by hand in `shard_map`: each weight split over all 8 devices,
    all-gathered for the forward pass; its gradient, which `jax.grad` reduces
    with a reduce-scatter (the all-gather's transpose)."""

    BATCH, WIDTH, HIDDEN = 64, 256, 512

    def write(self, c):
        import jax
        import jax.numpy as jnp

        every = ("data", "model")

        def body(w1, w2, x):
            def loss(w1, w2):
                full1 = jax.lax.all_gather(w1, every, axis=0, tiled=True)
                full2 = jax.lax.all_gather(w2, every, axis=0, tiled=True)
                h = jnp.tanh(jnp.dot(x, full1, precision="highest"))
                return jnp.sum(jnp.dot(h, full2, precision="highest") ** 2)

            return jax.grad(loss, argnums=(0, 1))(w1, w2)

        f = c.shard_map(body, in_specs=[(every,), (every,), (every,)], out_specs=[(every,)] * 2)
        w1 = c.sds((self.WIDTH, self.HIDDEN), (every,))
        w2 = c.sds((self.HIDDEN, self.WIDTH), (every,))
        x = c.sds((self.BATCH, self.WIDTH), (every,))
        compiled = jax.jit(f).lower(w1, w2, x).compile()
        weight = self.WIDTH * self.HIDDEN * F32
        rows = self.BATCH // (DATA * MODEL)
        product = 2 * rows * self.WIDTH * self.HIDDEN  # each of the five products
        all8 = groups("data", "model")
        return compiled, {
            "collectives": [
                collective("all-gather", weight, all8),
                collective("all-gather", weight, all8),
                collective("reduce-scatter", weight, all8),  # the whole gradient, its operand
                collective("reduce-scatter", weight, all8),
            ],
            # forward: x @ w1, h @ w2; backward: dh, dw2, dw1 (x needs no gradient)
            "flops": 5 * product,
        }


class Megatron(Program):
    """A Megatron MLP step under `jit` shardings: the first weight split by
    columns over `model`, the second by rows, the batch over `data`. The
    partitioner all-reduces the output's partial sums over `model` and each
    weight's gradient over `data`."""

    BATCH, WIDTH, HIDDEN = 32, 256, 1024

    def write(self, c):
        import jax
        import jax.numpy as jnp

        def loss(w1, w2, x):
            h = jnp.tanh(jnp.dot(x, w1, precision="highest"))
            return jnp.sum(jnp.dot(h, w2, precision="highest") ** 2)

        step = jax.grad(loss, argnums=(0, 1))
        w1 = c.sds((self.WIDTH, self.HIDDEN), (None, "model"))
        w2 = c.sds((self.HIDDEN, self.WIDTH), ("model", None))
        x = c.sds((self.BATCH, self.WIDTH), ("data", None))
        out = (c.sharding(None, "model"), c.sharding("model", None))
        compiled = jax.jit(step, out_shardings=out).lower(w1, w2, x).compile()
        rows = self.BATCH // DATA
        columns = self.HIDDEN // MODEL
        gradient = self.WIDTH * columns * F32  # each device's part of each weight
        product = 2 * rows * self.WIDTH * columns
        return compiled, {
            "collectives": [
                collective("all-reduce", rows * self.WIDTH * F32, groups("model")),
                # both gradients' partial sums over the batch (XLA combines the two)
                collective("all-reduce", 2 * gradient, groups("data")),
            ],
            "flops": 5 * product,  # forward 2, backward 3 (x needs no gradient)
        }


class ScanReplicated(Program):
    """Six stacked layers run by `jax.lax.scan`, every array replicated: each
    device runs every product of every layer, forward and backward."""

    LAYERS, BATCH, WIDTH = 6, 16, 64

    def write(self, c):
        import jax
        import jax.numpy as jnp

        def loss(ws, x):
            def layer(x, w):
                return jnp.tanh(jnp.dot(x, w, precision="highest")), None

            return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

        ws = c.sds((self.LAYERS, self.WIDTH, self.WIDTH), ())
        x = c.sds((self.BATCH, self.WIDTH), ())
        compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
        product = 2 * self.BATCH * self.WIDTH * self.WIDTH
        return compiled, {
            "collectives": [],
            # per layer: forward x @ w; backward dx and dw
            "flops": self.LAYERS * 3 * product,
            "loops": True,
        }


class Nested(Program):
    """Nested loops in `shard_map`: an outer `scan` of 3 steps gathers over `data`
    and runs an inner `scan` of 4 steps, which all-reduces over `model`."""

    OUTER, INNER, N = 3, 4, 32

    def write(self, c):
        import jax
        import jax.numpy as jnp

        def body(x, w):
            def outer(x, _):
                g = jax.lax.all_gather(x[: self.N // DATA], "data", axis=0, tiled=True)

                def inner(y, _):
                    y = jax.lax.psum(jnp.dot(y, w, precision="highest"), "model")
                    return jnp.tanh(y), None

                return jax.lax.scan(inner, x + g, None, length=self.INNER)[0], None

            return jax.lax.scan(outer, x, None, length=self.OUTER)[0]

        f = c.shard_map(body, in_specs=[(), ()], out_specs=())
        x = c.sds((self.N, self.N), ())
        w = c.sds((self.N, self.N), ())
        compiled = jax.jit(f).lower(x, w).compile()
        square = self.N * self.N * F32
        return compiled, {
            "collectives": [
                collective("all-gather", square, groups("data"), count=self.OUTER),
                collective("all-reduce", square, groups("model"), count=self.OUTER * self.INNER),
            ],
            "flops": self.OUTER * self.INNER * 2 * self.N**3,
            "loops": True,
        }


class Switch(Program):
    """`jax.lax.switch` over 8 branches in `shard_map`: branch k runs k % 3 + 1
    products; the even ones all-reduce over `model`, the odd ones all-gather over
    it. One run takes one branch: the FLOPs are the heaviest branch's, and of
    each kind of collective the branch that moves the most counts."""

    BRANCHES, ROWS, WIDTH = 8, 16, 64

    def write(self, c):
        import jax
        import jax.numpy as jnp

        def branch(k):
            def run(x, w):
                for _ in range(k % 3 + 1):
                    x = jnp.tanh(jnp.dot(x, w, precision="highest"))
                if k % 2:
                    return jax.lax.all_gather(x, "model", axis=0, tiled=True)[: self.ROWS]
                return jax.lax.psum(x, "model")

            return run

        def body(i, x, w):
            return jax.lax.switch(i, [branch(k) for k in range(self.BRANCHES)], x, w)

        f = c.shard_map(body, in_specs=[(), (), ()], out_specs=())
        i = c.sds((), (), "int32")
        x = c.sds((self.ROWS, self.WIDTH), ())
        w = c.sds((self.WIDTH, self.WIDTH), ())
        compiled = jax.jit(f).lower(i, x, w).compile()
        block = self.ROWS * self.WIDTH * F32
        return compiled, {
            "collectives": [
                collective("all-reduce", block, groups("model")),
                collective("all-gather", MODEL * block, groups("model")),
            ],
            "flops": 3 * 2 * self.ROWS * self.WIDTH * self.WIDTH,  # branch 2: 3 products
            "branches": True,
        }


# dtype: (its bits, the bits XLA:CPU gathers it as: it widens types its
# collectives do not take, as the compiled text shows with a convert before each)
DTYPES = {
    "int4": (4, 8),  # to s8
    "uint4": (4, 8),  # to u8
    "float4_e2m1fn": (4, 16),  # every narrow float to f16 ...
    "float8_e3m4": (8, 16),
    "float8_e4m3": (8, 16),
    "float8_e4m3fn": (8, 16),
    "float8_e4m3fnuz": (8, 16),
    "float8_e4m3b11fnuz": (8, 16),
    "float8_e5m2": (8, 16),
    "float8_e5m2fnuz": (8, 16),
    "float8_e8m0fnu": (8, 32),  # ... but this one, whose exponent needs f32
    "bfloat16": (16, 32),  # to f32
    "int8": (8, 8),
}


class Dtypes(Program):
    """An all-gather over `model` of an array of each narrow dtype, in `shard_map`
    (and on XLA:CPU one of int2 over `data`: XLA:TPU refuses int2). XLA:TPU
    gathers each as it is, packing 4-bit types two to a byte; XLA:CPU first
    widens most (`DTYPES` says to what). The int2
    array gathered holds 6 elements, 12 bits: 2 bytes, as XLA packs it."""

    ROWS, COLUMNS = 2, 5

    def write(self, c):
        import jax
        import jax.numpy as jnp

        int2 = c.target == "cpu"

        def body(*xs):
            gathered = [jax.lax.all_gather(x, "model", axis=0, tiled=True) for x in xs]
            if int2:
                gathered[-1] = jax.lax.all_gather(xs[-1], "data", axis=0, tiled=True)
            return tuple(gathered)

        arrays = [c.sds((self.ROWS, self.COLUMNS), (), getattr(jnp, n)) for n in DTYPES]
        if int2:
            arrays.append(c.sds((1, 3), (), jnp.int2))
        f = c.shard_map(body, in_specs=[()] * len(arrays), out_specs=[()] * len(arrays))
        compiled = jax.jit(f).lower(*arrays).compile()
        elements = MODEL * self.ROWS * self.COLUMNS  # gathered
        expected = []
        for bits, cpu_bits in DTYPES.values():
            moved = cpu_bits if c.target == "cpu" else bits
            expected.append(collective("all-gather", -(-elements * moved // 8), groups("model")))
        if int2:
            expected.append(collective("all-gather", -(-DATA * 3 * 2 // 8), groups("data")))
        return compiled, {"collectives": expected, "flops": 0}


class Notations(Program):
    """Reshardings under `jit` that XLA writes in each notation of device groups:
    a dim split over (`model`, `data`) gathered whole (JAX 0.8: iota
    `[1,8]<=[2,4]T(1,0)`; 0.10: `mesh[...], device_ids=(...)`; 0.12: the user's
    axis names), the same gathered over `data` only (`[4,2]<=[2,4]T(1,0)`), and a
    (data, model) layout turned into (model, data): an all-to-all over a sub-axis
    of `model` and a permute."""

    N = 64

    def write(self, c):
        import jax

        def f(a, b, d):
            return a * 2, b * 3, d * 5

        a = c.sds((self.N, self.N), (("model", "data"),))
        b = c.sds((self.N, self.N), (("model", "data"),))
        d = c.sds((self.N, self.N), ("data", "model"))
        out = (c.sharding(), c.sharding("model"), c.sharding("model", "data"))
        compiled = jax.jit(f, out_shardings=out).lower(a, b, d).compile()
        whole = self.N * self.N * F32
        block = whole // (DATA * MODEL)  # what each device holds of `d`
        return compiled, {
            "collectives": [
                collective("all-gather", whole, groups("data", "model")),
                collective("all-gather", whole // MODEL, groups("data")),
                # How to transpose the layout is the partitioner's choice: an
                # all-to-all of each device's block between neighbours along
                # `model` (the groups JAX 0.8 writes as the plain iota [4,2]<=[8],
                # which the sub-axis notations of 0.10 and 0.12 must equal), then a
                # permute of the block, between devices that differ along both axes.
                collective("all-to-all", block, [[0, 1], [2, 3], [4, 5], [6, 7]]),
                {
                    "kind": "collective-permute",
                    "bytes": block,
                    "count": 1,
                    "axes": ["data", "model"],
                },
            ],
            "flops": 0,
        }


class Kernel(Program):
    """`jax.lax.ragged_dot`, which XLA:TPU runs as a Pallas kernel (a
    `tpu_custom_call`) whose backend config carries its cost estimate: every row
    of `a` times the matrix of its group."""

    targets = ("tpu",)
    ROWS, INNER, COLUMNS, GROUPS = 256, 128, 256, 4

    def write(self, c):
        import jax
        import jax.numpy as jnp

        a = c.sds((self.ROWS, self.INNER), ())
        b = c.sds((self.GROUPS, self.INNER, self.COLUMNS), ())
        sizes = c.sds((self.GROUPS,), (), jnp.int32)
        compiled = jax.jit(jax.lax.ragged_dot).lower(a, b, sizes).compile()
        return compiled, {
            "collectives": [],
            "flops": 2 * self.ROWS * self.INNER * self.COLUMNS,
        }


PROGRAMS: dict[str, Program] = {
    "collectives": Collectives(),
    "fsdp": Fsdp(),
    "megatron": Megatron(),
    "scan_replicated": ScanReplicated(),
    "nested": Nested(),
    "switch": Switch(),
    "dtypes": Dtypes(),
    "notations": Notations(),
    "kernel": Kernel(),
}

if __name__ == "__main__":
    sys.exit(main())
