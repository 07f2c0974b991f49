"""The package's structure as docs/architecture.md states it: layers, no import circles, small files.

``tools/architecture.py`` reads the imports from the source; each rule is also checked on a small
made-up package that breaks it, so that a checker which finds nothing is not mistaken for a
package that breaks nothing.
"""

from __future__ import annotations

from tools.architecture import breaches, package_sources


def test_the_package_keeps_every_rule() -> None:
    sources, packages = package_sources()
    assert len(sources) > 50 and {"strategy", "parallelize", "config", "checkpoint"} <= packages
    assert breaches(sources, packages) == []


def _fake(**modules: str) -> tuple[dict[str, str], set[str]]:
    sources = {f"lightning_parallel.{name.replace('__', '.')}": text for name, text in modules.items()}
    packages = {name.split("__")[0] for name in modules if "__" in name}
    return sources, packages


def test_an_import_circle_is_found() -> None:
    sources, packages = _fake(
        mesh__a="from lightning_parallel.mesh.b import f\n",
        mesh__b="from lightning_parallel.mesh.a import g\n",
    )
    assert breaches(sources, packages) == [
        "import circle between modules: lightning_parallel.mesh.a -> lightning_parallel.mesh.b"
    ]


def test_an_import_up_the_layers_is_found() -> None:
    sources, packages = _fake(
        mesh__a="def f(): from lightning_parallel.strategy.b import g\n", strategy__b="x = 1\n"
    )
    assert breaches(sources, packages) == ["mesh imports strategy, a higher layer"]


def test_checkpoint_outside_the_strategy_and_private_names_are_found() -> None:
    sources, packages = _fake(
        parallelize__a="from lightning_parallel.checkpoint.b import _helper\n",
        checkpoint__b="def _helper(): ...\n",
    )
    assert breaches(sources, packages) == [
        "parallelize imports checkpoint (only strategy and the top may)",
        "lightning_parallel.parallelize.a imports the private name _helper of lightning_parallel.checkpoint.b",
    ]


def test_long_files_ignores_and_self_probes_are_found() -> None:
    sources, packages = _fake(
        zero__a="x = 1\n" * 401,
        strategy__b='y = getattr(self, "dims", None)\nz = 1  # type: ignore[attr-defined]\n',
    )
    assert breaches(sources, packages) == [
        "lightning_parallel.zero.a has 401 lines (at most 400: a module longer than that is two)",
        "lightning_parallel.strategy.b has a `type: ignore[attr-defined]`",
        "lightning_parallel.strategy.b probes its own attributes with getattr(self, ...)",
    ]


def test_the_example_of_docs_architecture_prints_what_it_says(capsys) -> None:
    """The page's example runs as printed, and prints the lines the page shows after it."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "docs/architecture.md", "exec"), {"__name__": "docs_example"})
    shown = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    assert capsys.readouterr().out.splitlines() == shown and len(shown) == 4
