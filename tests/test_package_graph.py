"""docs/structure.md's picture of the package graph is the one the real imports give."""

from pathlib import Path

from benchmarks import package_graph

ROOT = Path(__file__).resolve().parents[1]


def test_the_picture_in_structure_md_is_the_real_package_graph():
    doc = package_graph.in_doc((ROOT / "docs" / "structure.md").read_text())
    assert doc is not None, "docs/structure.md lost the package-graph markers"
    now = package_graph.mermaid()
    assert doc == now, ("docs/structure.md's package graph is out of date with the imports: run "
                        "`python -m benchmarks.package_graph --write`\nnow:\n" + now)
    # the graph was read, and it is the house's: the services on the contracts, never on each other
    lines = set(now.splitlines())
    assert {"    ivy --> trellis", "    tulip --> rose", "    tulip --> trellis"} <= lines
    assert not any(line.startswith(("    ivy --> tulip", "    ivy -.-> tulip", "    rose --> tulip")) for line in lines)


def test_the_generator_finds_new_packages_and_tells_eager_from_lazy_imports(tmp_path):
    def module(rel, text):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    module("base/__init__.py", "")
    module("base/util.py", "import os\n")
    module("svc/__init__.py", "from base import util\n")
    module("svc/inner/__init__.py", "from . import x\nfrom .. import y\n")  # relative: inside svc
    module("late/__init__.py", "")
    module("late/job.py", "import base.util\n\ndef run():\n    import svc\n    from svc.inner import z\n")
    module("guarded/__init__.py", "try:\n    import svc\nexcept ImportError:\n    svc = None\n")
    module("tests/__init__.py", "import svc\n")  # tests are not a package of the picture
    module("notapkg/mod.py", "import svc\n")  # no __init__.py: not a package
    assert package_graph.packages(tmp_path) == ["base", "guarded", "late", "svc"]
    assert package_graph.edges(tmp_path) == {("svc", "base"): True, ("late", "base"): True, ("late", "svc"): False,
                                             ("guarded", "svc"): True}
    block = package_graph.mermaid(tmp_path)
    assert "    late -.-> svc" in block and "    late --> base" in block and block.startswith("```mermaid\ngraph TD")

    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n\n{package_graph.BEGIN}\nstale\n{package_graph.END}\n\ntail\n")
    assert package_graph.write(doc, tmp_path) and package_graph.in_doc(doc.read_text()) == block
    assert doc.read_text().endswith("\n\ntail\n") and not package_graph.write(doc, tmp_path)  # second write: no change
