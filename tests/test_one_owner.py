"""Every name and number the code shares has one owner, and every other place reads it
from there:
- the kernel names in kernel_plan, the reference's builds and the variable that
  forces one (gateeng/plans/kernel_names.py);
- the routes of a VERIFIED decode and their policies, the plans, the dtypes, the
  determinism modes and stream policies (gateeng/config.py; "off" and "reference" are
  words of their own elsewhere, so the test follows "verified" and the policies, and
  checks that every list of modes is derived from config.Mode);
- the model types the engine runs and the GGUF architectures it reads natively
  (gateeng/model/families.py, the one table of model families);
- the dot's block count: plans/tp_shapes.py, kernels/ref_ops.cpp and
  kernels/triton_reference.py each name it, in their own language, and it is the
  number kernels/SPEC.md states.
A string literal equal to an owned name anywhere else in the package is a second
owner, free to drift from the first; so is a second value of the block count. Two
builds are named for the CPU flag they need ("avx2", "avx512_bf16"): a line that
lists /proc/cpuinfo flags says so with a `# cpuinfo flags` comment, and its
literals are flags, not build names."""
import ast
import re
from pathlib import Path

from gateeng import config
from gateeng.model import families
from gateeng.plans import kernel_names, tp_shapes

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateeng"

# owner module (relative to the repository) -> the names only it may spell out
OWNED = {
    "gateeng/plans/kernel_names.py": {*kernel_names.ROWWISE_MATMULS, kernel_names.ONEDNN_PACKED,
                                      kernel_names.TORCH_MM, kernel_names.REFERENCE, *kernel_names.REFERENCE_ISAS,
                                      kernel_names.ISA_ENV},
    "gateeng/config.py": {*config.ROUTE_POLICIES, *config.PLANS, *config.DTYPES, config.Mode.VERIFIED.value,
                          *(p.value for p in config.StreamPolicy)},
    "gateeng/model/families.py": {*families.SUPPORTED, *families.GGUF_ARCHITECTURES,
                                  *families.GGUF_MOE_ARCHITECTURES},
}
CPU_FLAGS = "# cpuinfo flags"


def second_owners(package: Path = PACKAGE) -> list:
    """'path:line: name (owned by owner)' for each string literal in the package equal
    to a name another module owns."""
    owner_of = {name: owner for owner, names in OWNED.items() for name in names}
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if CPU_FLAGS in lines[node.lineno - 1]:
                    continue
                owner = owner_of.get(node.value)
                if owner is not None and owner != rel:
                    found.append(f"{rel}:{node.lineno}: {node.value!r} (owned by {owner})")
    return found


def cpp_dot_blocks(source: str) -> int:
    found = re.findall(r"^constexpr\s+int64_t\s+DOT_BLOCKS\s*=\s*(\d+)\s*;", source, re.M)
    assert len(found) == 1, f"ref_ops.cpp names DOT_BLOCKS {len(found)} times"
    return int(found[0])


def triton_dot_blocks(source: str) -> int:
    """DOT_BLOCKS = tl.constexpr(N) at the module's top level, read without importing
    triton."""
    values = [node.value for node in ast.parse(source).body
              if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DOT_BLOCKS"]]
    assert len(values) == 1, f"triton_reference.py names DOT_BLOCKS {len(values)} times"
    call = values[0]
    assert isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
    return call.args[0].value


def spec_dot_blocks(spec: str) -> set:
    """The block counts SPEC.md's "dot" section states: in per = ceil(P/N) and in the
    block indices l = 0..N-1."""
    section = spec.split("## dot(", 1)[1].split("\n## ", 1)[0]
    per = {int(n) for n in re.findall(r"per = ceil\(P/(\d+)\)", section)}
    last = {int(n) + 1 for n in re.findall(r"l = 0\.\.(\d+)", section)}
    assert per and last, "SPEC.md's dot section no longer states its block count in the form this test reads"
    return per | last


def dot_blocks(root: Path = ROOT) -> dict:
    """The dot's block count as each owner writes it."""
    return {"plans/tp_shapes.py": tp_shapes.DOT_BLOCKS,
            "kernels/ref_ops.cpp": cpp_dot_blocks((root / "gateeng/kernels/ref_ops.cpp").read_text()),
            "kernels/triton_reference.py": triton_dot_blocks((root / "gateeng/kernels/triton_reference.py").read_text()),
            **{f"kernels/SPEC.md ({n})": n for n in spec_dot_blocks((root / "kernels/SPEC.md").read_text())}}


def test_owned_names_are_spelled_out_only_by_their_owner():
    found = second_owners()
    assert not found, "import these from their owner:\n" + "\n".join(found)


def test_every_owner_spells_its_names():
    for owner, names in OWNED.items():
        source = (ROOT / owner).read_text()
        for name in names:
            assert repr(name) in source or f'"{name}"' in source, (owner, name)


def test_every_list_of_modes_is_configs():
    from gateeng import request
    from gateeng.serving import checks, metrics
    modes = [m.value for m in config.Mode]
    assert request.Mode is config.Mode and request.StreamPolicy is config.StreamPolicy
    assert set(config.REQUEST_MODES) <= set(modes) and list(checks.MODES) == list(config.REQUEST_MODES)
    assert list(metrics.DETERMINISM) == modes
    assert [f"MODE_{m.upper()}" for m in modes if m in config.REQUEST_MODES] == [
        n for n in pb_modes() if n != "MODE_UNSPECIFIED"]


def pb_modes() -> list:
    from gateeng.v1 import engine_pb2 as pb
    return list(pb.Determinism.Mode.keys())


def test_the_dot_has_one_block_count():
    counts = dot_blocks()
    assert set(counts.values()) == {16}, counts


def test_a_second_owner_is_caught(tmp_path):
    pkg = tmp_path / "gateeng"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "x.py").write_text(f'ROUTE = {config.DIRECT!r}\nK = "{kernel_names.TORCH_MM}"\n'
                                         f'ok = "{config.DIRECT} route"\n'
                                         f'BUILD = "{kernel_names.AVX2}"\n'
                                         f'NEEDS = {{"{kernel_names.AVX2}", "fma"}}   {CPU_FLAGS}\n')
    (pkg / "config.py").write_text(f'DIRECT = {config.DIRECT!r}\n')
    assert [f.split(" (")[0] for f in second_owners(pkg)] == [
        f"gateeng/engine/x.py:1: {config.DIRECT!r}", f"gateeng/engine/x.py:2: {kernel_names.TORCH_MM!r}",
        f"gateeng/engine/x.py:4: {kernel_names.AVX2!r}"]


def test_a_second_block_count_is_caught():
    assert cpp_dot_blocks("x\nconstexpr int64_t DOT_BLOCKS = 8;\n") == 8
    assert triton_dot_blocks("import triton.language as tl\nDOT_BLOCKS = tl.constexpr(8)\n") == 8
    assert spec_dot_blocks("## dot(a, b)\n- Blocks: `per = ceil(P/8)`; block l (l = 0..15) is\n## sum\n") == {8, 16}
