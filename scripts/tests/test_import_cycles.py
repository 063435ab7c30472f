"""scripts/import_cycles.py on tiny crates: a circle fails, a facade and a child's
test module do not, an allowed pair is reported without failing.
Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_import_cycles.py)."""

from __future__ import annotations

from support import expect, main, run, tree

#: (what the case shows, the crate's files, allowed pairs of its files, status, what the output says).
CASES = [
    ("a circle between two files fails", {
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "pub struct B;\nfn f() { let _ = super::a::A; }\n",
    }, [], 1, ["a.rs", "b.rs"]),
    ("a circle through three files and a brace list fails", {
        "lib.rs": "mod m;\n",
        "m/mod.rs": "mod x;\nmod y;\nmod z;\n",
        "m/x.rs": "use super::{y::Y, other};\npub struct X;\n",
        "m/y.rs": "use crate::m::z::Z;\npub struct Y;\n",
        "m/z.rs": "use super::x::X as Renamed;\npub struct Z;\n",
    }, [], 1, ["1 found"]),
    ("a facade's re-export and a test module are not circles", {
        "lib.rs": "pub mod m;\n",
        "m/mod.rs": "mod core;\nmod ops;\npub use core::Core;\npub use ops::op;\npub fn helper() {}\n",
        "m/core.rs": "pub struct Core;\nfn g() { super::helper(); }\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        "m/ops.rs": "use crate::m::Core;\npub fn op(_: &Core) {}\n",
    }, [], 0, ["0 found"]),
    ("an allowed pair is reported, not failed", {
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "use crate::a::A;\npub struct B;\n",
    }, [("a.rs", "b.rs")], 0, ["known (allowed)"]),
]


def test_each_crate_gets_its_status_and_its_words():
    for what, files, allowed, status, says in CASES:
        src = tree(files)
        allow = [w for a, b in allowed for w in ("--allow", f"{src / a}<->{src / b}")]
        try:
            expect(run("import_cycles.py", *allow, str(src)), status, *says)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from e


if __name__ == "__main__":
    main(globals())
