"""scripts/py_import_cycles.py on tiny packages: a load-time circle fails, an import in
a function or under TYPE_CHECKING does not count.
Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_py_import_cycles.py)."""

from __future__ import annotations

from support import expect, main, run, tree


def check(files: dict) -> object:
    return run("py_import_cycles.py", str(tree(files)))


def test_a_load_time_circle_fails_naming_both_files():
    r = check({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import f\n"})
    expect(r, 1, "pkg.a", "pkg.b")


def test_imports_in_functions_and_under_type_checking_do_not_count():
    r = check(
        {
            "pkg/__init__.py": "from .a import f\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import g\ndef f():\n    from . import b\n",
            "pkg/b.py": "from .a import f\n",
        }
    )
    expect(r, 0, "0 found")


if __name__ == "__main__":
    main(globals())
