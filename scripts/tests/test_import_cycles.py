"""scripts/import_cycles.py on tiny crates: a circle fails, a facade and a child's
test module do not, an allowed pair is reported without failing.
Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_import_cycles.py)."""

from __future__ import annotations

from pathlib import Path

from support import expect, main, run, tree


def check(src: Path, *allow: str) -> object:
    return run("import_cycles.py", *allow, str(src))


def test_a_circle_between_two_files_fails():
    src = tree({
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "pub struct B;\nfn f() { let _ = super::a::A; }\n",
    })
    expect(check(src), 1, "a.rs", "b.rs")


def test_a_circle_through_three_files_and_a_brace_list_fails():
    src = tree({
        "lib.rs": "mod m;\n",
        "m/mod.rs": "mod x;\nmod y;\nmod z;\n",
        "m/x.rs": "use super::{y::Y, other};\npub struct X;\n",
        "m/y.rs": "use crate::m::z::Z;\npub struct Y;\n",
        "m/z.rs": "use super::x::X as Renamed;\npub struct Z;\n",
    })
    expect(check(src), 1, "1 found")


def test_a_facade_re_export_and_a_test_module_are_not_circles():
    src = tree({
        "lib.rs": "pub mod m;\n",
        "m/mod.rs": "mod core;\nmod ops;\npub use core::Core;\npub use ops::op;\npub fn helper() {}\n",
        "m/core.rs": "pub struct Core;\nfn g() { super::helper(); }\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        "m/ops.rs": "use crate::m::Core;\npub fn op(_: &Core) {}\n",
    })
    expect(check(src), 0, "0 found")


def test_an_allowed_pair_is_reported_not_failed():
    src = tree({
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "use crate::a::A;\npub struct B;\n",
    })
    expect(check(src, "--allow", f"{src / 'a.rs'}<->{src / 'b.rs'}"), 0, "known (allowed)")


if __name__ == "__main__":
    main(globals())
