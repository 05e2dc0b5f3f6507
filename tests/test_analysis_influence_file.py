"""``show --from FILE`` checks the whole file (tgattn.analysis.influence_file): a crafted or damaged file is
refused with one line naming its field, never a traceback or a blank page (issue 57, item 8)."""
import base64
import copy
import json

import numpy as np
import pytest

from conftest import one_line_error
from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import influence_data, save_influence
from tgattn.analysis.influence_file import check_influence
from tgattn.analysis.random_layers import random_attention

TOKENS = "the sky is blue and the sea is deep".split()


@pytest.fixture(scope="module")
def data():
    attention = random_attention(TOKENS, builders.causal(len(TOKENS)), layers=2, heads=2)
    attention[1][1][4, 1] = float("nan")  # a flagged weight: the flags field is checked too
    return influence_data(TOKENS, attention, top_k=3)


def b64(values, dtype):
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def edit(data, change):
    out = copy.deepcopy(data)
    change(out)
    return out


def set_(path, value):
    def change(d):
        *head, last = path
        for key in head:
            d = d[key]
        d[last] = value
    return change


CASES = [  # (what changes, the message that names the field)
    (set_(["title"], ["a", "list"]), r"title: must be a string \(got list\)"),
    (lambda d: d.pop("title"), "the file: has no field 'title'"),
    (set_(["layers"], {"0": []}), r"layers: must be a list \(got dict\)"),
    (set_(["layers"], []), r"layers: must hold 2 layers, as heads says \(got 0\)"),
    (set_(["layers", 1], []), r"layers\[1\]: must hold 3 views \(the mean and 2 heads; got 0\)"),
    (set_(["flow", "value", 0], float("nan")), r"flow.value\[0\]: must be a finite number \(got nan\)"),
    (set_(["flow", "value", 0], -1.0), r"flow.value\[0\]: a flow is >= 0"),
    (set_(["flow", "index", 0], 99), r"flow.index\[0\]: must be a token index in \[0, 9\) \(got 99\)"),
    (set_(["pruned", 0, 1, "total"], float("inf")), r"pruned\[0\]\[1\].total: must be a finite number \(got inf\)"),
    (set_(["pruned", 1, 0, "total"], 3.0), r"pruned\[1\]\[0\].total: must be null where nonfinite counts"),
    (set_(["rollout_pruned", "edges"], True), "rollout_pruned.edges: must be an integer"),
    (set_(["tokens"], []), r"tokens: the page needs at least one token \(got \[\]\)"),
    (set_(["tokens", 2], 7), r"tokens\[2\]: must be a string \(got int\)"),
    (set_(["query"], 9), r"query: must be a token index in \[0, 9\) \(got 9\)"),
    (set_(["heads"], [2, 0]), r"heads\[1\]: must be an integer in \[1, 65536\] \(got 0\)"),
    (set_(["keep", "threshold"], 1.5), r"keep.threshold: must be in \[0, 1\)"),
    (set_(["index_bytes"], 4), "index_bytes: must be 2 for 9 tokens"),
    (set_(["layers", 0, 0, "counts"], "not base64!"), r"layers\[0\]\[0\].counts: is not base64"),
    (set_(["layers", 0, 0, "counts"], b64([1] * 8, "<u2")), r"layers\[0\]\[0\].counts: must hold 9 values of 2 bytes"),
    (set_(["layers", 0, 2, "counts"], b64([9] + [1] * 8, "<u2")), r"layers\[0\]\[2\].counts: a token keeps 9 keys, more than"),
    (set_(["rollout", "scale"], b64([np.nan] * 9, "<f4")), "rollout.scale: every scale must be finite and >= 0"),
    (set_(["layers", 1, 2, "flags"], b64([0] * 100, "u1")), r"layers\[1\]\[2\].flags: must hold \d+ values of 1 bytes"),
    (set_(["layers", 0, 1, "extra"], "x"), r"layers\[0\]\[1\]: has an unknown field 'extra'"),
    (set_(["flow"], {"token": 1}), "flow: has no field 'index'"),
]


@pytest.mark.parametrize("change, message", CASES, ids=[c[1][:40] for c in CASES])
def test_a_wrong_field_is_named(data, change, message):
    check_influence(data)  # the file as written passes
    with pytest.raises(ValueError, match=f"^{message}"):
        check_influence(edit(data, change))


def test_a_key_past_the_tokens_is_refused(data):
    view = data["rollout"]
    keys = np.frombuffer(base64.b64decode(view["keys"]), dtype="<u2").copy()
    keys[-1] = 9
    with pytest.raises(ValueError, match=r"^rollout.keys: key 9 is not a token \(9 tokens\)"):
        check_influence(edit(data, set_(["rollout", "keys"], b64(keys, "<u2"))))


@pytest.mark.parametrize("content, message", [
    ("[" * 100_000, "nests its values too deeply for an influence file"),
    ('{"format": "tgattn.influence", "version": 1, "title": [1]}', "the file: has no field 'tokens'"),
    ("not json", "is not a JSON file"),
])
def test_show_from_refuses_a_bad_file_with_one_line(tmp_path, cli, content, message):
    source, page = tmp_path / "data.json", tmp_path / "page.html"
    source.write_text(content)
    status, err = cli(main, ["show", "--from", str(source), "--html", str(page)])
    assert status == 2 and message in one_line_error(err, "python -m tgattn show")
    assert not page.exists()


def test_show_from_names_the_field_and_refuses_a_file_over_the_budget(tmp_path, cli, data):
    source, page = tmp_path / "data.json", tmp_path / "page.html"
    bad = edit(data, set_(["flow", "value", 1], float("nan")))
    source.write_text(json.dumps(bad))  # Python writes the bare NaN a crafted file may hold
    status, err = cli(main, ["show", "--from", str(source), "--html", str(page)])
    assert status == 2 and one_line_error(err, "python -m tgattn show") == \
        f"{source}: flow.value[1]: must be a finite number (got nan)"
    save_influence(data, source)
    status, err = cli(main, ["show", "--from", str(source), "--html", str(page), "--max-page-mb", "0.001"])
    assert status == 2 and f"{source} takes 0.0" in one_line_error(err, "python -m tgattn show")
    assert not page.exists()
    assert main(["show", "--from", str(source), "--html", str(page)]) == 0  # the file as written makes its page
