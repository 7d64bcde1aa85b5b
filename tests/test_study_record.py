"""A finished study's bundled record (``studies.record``): every run's start and end read from its folder, the
runs started before a moment, a bundle refused for an unfinished study; and the confirmatory study's readout
(``readouts.confirmatory``) against a hand-built study whose differences are known."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from lopti_lab import readouts
from lopti_lab.studies.curves import WARM, model_name
from lopti_lab.studies.primary import primary_table
from lopti_lab.studies.record import BUNDLED, bundle, run_times, started_before

METHODS = ("GRPO", "GRPO+AR", "GRPO+Lopti")


def _run(report, name, start, end, sessions):
    folder = report / "runs" / name
    folder.mkdir(parents=True)
    (folder / "times.json").write_text(json.dumps({"start": start, "end": end, "sessions": sessions}))


def _report(tmp_path, finished=True):
    report = tmp_path / "report"
    _run(
        report,
        "grpo-seed5",
        "2026-12-06T07:59:46+00:00",
        "2026-12-06T09:00:00+00:00",
        [["2026-12-06T07:59:46+00:00", None], ["2026-12-06T08:30:00+00:00", "2026-12-06T09:00:00+00:00"]],
    )
    _run(report, "grpo_lopti-seed5", "2026-12-06T08:00:00+00:00", "2026-12-06T10:00:00+00:00" if finished else None,
         [["2026-12-06T08:00:00+00:00", "2026-12-06T10:00:00+00:00" if finished else None]])  # fmt: skip
    for name in BUNDLED:
        (report / f"{name}.csv").write_text(f"name\n{name}\n")
    return report


def test_run_times_reads_every_runs_start_end_and_killed_processes(tmp_path):
    times = run_times(_report(tmp_path), METHODS)
    assert times["run"].tolist() == ["grpo-seed5", "grpo_lopti-seed5"]
    assert times["model"].tolist() == [model_name("GRPO"), model_name("GRPO+Lopti")] and set(times["seed"]) == {5}
    assert times["sessions"].tolist() == [2, 1] and times["open_sessions"].tolist() == [1, 0]
    assert pd.isna(times.loc[0, "kept_h"]) and times.loc[1, "kept_h"] == 2.0  # a killed session, no checkpoint time
    assert times.loc[0, "start"] == pd.Timestamp("2026-12-06T07:59:46Z")
    late = started_before(times, "2026-12-06T07:59:59Z")
    assert late["run"].tolist() == ["grpo-seed5"]  # the moment is inclusive of the run that started before it
    assert started_before(times, "2026-12-06T06:41:29Z").empty


def test_kept_hours_end_a_killed_process_at_its_last_checkpoint(tmp_path):
    """GRPO: killed after 30 min, its last checkpoint at 20, resumed for 60 min: 1 h 20 kept. Lopti: killed before
    its first checkpoint (nothing kept), then 2 h to its end."""
    report = tmp_path / "report"
    for name, sessions, saved in (
        ("grpo-seed5", [["2026-12-06T08:00:00Z", None], ["2026-12-06T09:00:00Z", "2026-12-06T10:00:00Z"]],
         ["2026-12-06T08:20:00Z", "2026-12-06T09:50:00Z"]),
        ("grpo_lopti-seed5", [["2026-12-06T08:00:00Z", None], ["2026-12-06T09:00:00Z", "2026-12-06T11:00:00Z"]],
         [None, "2026-12-06T10:50:00Z"]),
    ):  # fmt: skip
        _run(report, name, sessions[0][0], sessions[-1][1], sessions)
        times = json.loads((report / "runs" / name / "times.json").read_text())
        (report / "runs" / name / "times.json").write_text(json.dumps({**times, "saved": saved}))
    kept = run_times(report, METHODS).set_index("run")["kept_h"]
    assert kept["grpo-seed5"] == pytest.approx(4 / 3) and kept["grpo_lopti-seed5"] == pytest.approx(2.0)


def test_bundle_copies_the_tables_and_writes_the_times(tmp_path):
    out = tmp_path / "data"
    times = bundle(_report(tmp_path), out, METHODS, runs=2)
    assert {p.name for p in out.iterdir()} == {*(f"{n}.csv" for n in BUNDLED), "times.csv"}
    assert (out / "primary.csv").read_text() == "name\nprimary\n"
    again = pd.read_csv(out / "times.csv")
    assert again["run"].tolist() == times["run"].tolist()
    assert pd.to_datetime(again["end"]).tolist() == times["end"].tolist()


def test_an_unfinished_or_short_study_is_not_bundled(tmp_path):
    with pytest.raises(ValueError, match=r"unfinished \['grpo_lopti-seed5'\]"):
        bundle(_report(tmp_path, finished=False), tmp_path / "data", METHODS, runs=2)
    report = _report(tmp_path / "b")
    with pytest.raises(ValueError, match="2 of 3 runs"):
        bundle(report, tmp_path / "data", METHODS, runs=3)
    (report / "primary.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"primary\.csv"):
        bundle(report, tmp_path / "data", METHODS, runs=2)
    _run(report, "grpo_kl-seed5", "2026-12-06T08:00:00+00:00", None, [])
    with pytest.raises(ValueError, match="grpo_kl-seed5"):
        run_times(report, METHODS)
    assert not (tmp_path / "data").exists()


def _study(lopti3, ar3, lopti2):
    """Sampled curves of 3 seeds: GRPO at 0.40 (3 people) and 0.60 (2) at steps 40-60, each fix plus its per-seed
    difference there; every run starts from 0.2 / 0.3 at step 0."""
    rows = []
    for i, seed in enumerate((5, 6, 7)):
        rows.append({"model": WARM, "seed": seed, "step": 0, "2ppl": 0.3, "3ppl": 0.2})
        for method, d3, d2 in (("GRPO", 0, 0), ("GRPO+AR", ar3[i], 0), ("GRPO+Lopti", lopti3[i], lopti2[i])):
            rows.append({"model": model_name(method), "seed": seed, "step": 0, "2ppl": 0.3, "3ppl": 0.2})
            for step in (10, 40, 50, 60):
                rows.append({"model": model_name(method), "seed": seed, "step": step, "2ppl": 0.6 + d2,
                             "3ppl": 0.4 + d3})  # fmt: skip
    curves = pd.DataFrame(rows)
    curves["avg"] = (curves["2ppl"] + curves["3ppl"]) / 2
    return curves


def test_the_confirmatory_readout_says_the_tables_numbers():
    """Lopti +0.10, +0.11, +0.12 at 3 people: mean +11.0 points, sd 1 point, t = 11 sqrt(3) = 19.05 on 2 degrees of
    freedom, p = 1 - 19.05 / sqrt(2 + 19.05^2) = 0.0027, the smallest of three, Holm x 3 = 0.008: it separates.
    AR -0.02, 0.00, +0.02 and Lopti at 2 people -0.01, +0.01, +0.03 do not."""
    curves = _study(lopti3=(0.10, 0.11, 0.12), ar3=(-0.02, 0.0, 0.02), lopti2=(-0.01, 0.01, 0.03))
    table = primary_table(curves)
    text = readouts.confirmatory(table, curves)
    assert "At 3 people GRPO goes from 0.20 at step 0 to 0.40 (its mean over steps 40, 50, 60, 3 seeds)" in text
    assert "At 2 people GRPO goes from 0.30 at step 0 to 0.60" in text
    lopti = table.iloc[0]
    assert lopti["p_holm"] == pytest.approx(0.0081, abs=2e-4) and lopti["holm_reject"]
    assert "GRPO+Lopti - GRPO at 3 people +11.0 ± 2.5 points (p 0.003, Holm p 0.008; above / level / below in " \
           "3 / 0 / 0 seeds) separates from GRPO" in text  # fmt: skip
    assert "GRPO+AR - GRPO at 3 people +0.0 ± 5.0 points" in text
    assert "1 / 1 / 1 seeds) does not separate from GRPO" in text
    assert "Separating after the correction, 1 of 3: GRPO+Lopti at 3 people." in text
    assert f"could detect {100 * lopti['detectable']:.1f} points" in text
    none = readouts.confirmatory(primary_table(_study((0.1, -0.1, 0.0), (0.0, 0.01, -0.01), (0.02, -0.02, 0.0))),
                                 curves)  # fmt: skip
    assert "None of the 3 primary comparisons separates" in none
    assert "Taken alone" not in text and "Taken alone" not in none, "no uncorrected interval excludes 0 there"


def test_the_confirmatory_readout_names_intervals_that_only_the_correction_keeps_level():
    """Lopti +0.03, +0.05, +0.07 at 3 people: t = (5 / 2) sqrt(3) = 4.33 on 2 degrees of freedom, p = 1 - 4.33 /
    sqrt(2 + 4.33^2) = 0.049 alone, the smallest of three, Holm x 3 = 0.15: level after the correction, and named as
    failing only it (the others' p: 1.0 and 0.48)."""
    curves = _study(lopti3=(0.03, 0.05, 0.07), ar3=(-0.02, 0.0, 0.02), lopti2=(-0.01, 0.01, 0.03))
    table = primary_table(curves)
    lopti = table.iloc[0]
    assert lopti["p"] == pytest.approx(0.0494, abs=5e-4) and not lopti["holm_reject"]
    text = readouts.confirmatory(table, curves)
    assert "None of the 3 primary comparisons separates" in text
    assert "Taken alone (uncorrected), the 95% interval of GRPO+Lopti at 3 people excludes 0: it fails only" in text


def test_the_number_table_recomputes_the_confirmatory_study_from_its_bundle(tmp_path, monkeypatch):
    """scripts/number_table.py: the bundled curves give the page's table and its keyed numbers (points x 100), the
    span from times.csv and the memory from memory.json; a page with the table's markers and no bundle is refused."""
    from scripts_loader import load_script

    nt = load_script("number_table")
    study = _study((0.10, 0.11, 0.12), (-0.02, 0.0, 0.02), (-0.01, 0.01, 0.03))
    for mode in ("sample", "greedy"):
        study.to_csv(tmp_path / f"curves_{mode}.csv", index=False)
    pd.DataFrame({"start": ["2026-12-06T08:00:00Z", "2026-12-06T09:00:00Z"],
                  "end": ["2026-12-06T10:00:00Z", "2026-12-06T20:30:00Z"]}).to_csv(tmp_path / "times.csv")  # fmt: skip
    (tmp_path / "memory.json").write_text(json.dumps({"peak_tree_gb": 6.5, "note": "ps every 10 s"}))
    numbers = {n.key: n.value for n in nt.confirm_numbers(tmp_path)}
    assert numbers["confirm.lopti.3ppl.mean"] == pytest.approx(11.0)
    assert numbers["confirm.lopti.3ppl.half"] == pytest.approx(2.484, abs=1e-3)
    assert numbers["confirm.ar.3ppl.p"] == pytest.approx(1.0) and numbers["confirm.lopti.2ppl.n"] == 3
    assert numbers["confirm.span_h"] == pytest.approx(12.5) and numbers["confirm.peak_tree_gb"] == 6.5
    assert "confirm.note" not in numbers
    monkeypatch.setattr(nt, "CONFIRM", tmp_path)
    page = f"intro\n{nt.CONFIRM_BEGIN}\nstale\n{nt.CONFIRM_END}\nafter\n"
    text = nt.hard_lab_page(page)
    assert "stale" not in text and "| GRPO + Lopti - GRPO | 3 | +11.0 ± 2.5 (**separates**) |" in text
    assert text.endswith(f"{nt.CONFIRM_END}\nafter\n") and nt.hard_lab_page(text) == text
    assert "| secondary measure (uncorrected) |" in text
    assert nt.hard_lab_page("no markers\n") == "no markers\n"
    monkeypatch.setattr(nt, "CONFIRM", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"no curves_sample\.csv"):
        nt.hard_lab_page(page)


def test_the_secondary_measures_by_hand():
    """On the hand-built study: Lopti's average of 2 and 3 people is (d2 + d3) / 2 per seed, mean (0.01 + 0.11) / 2 =
    +6.0 points; its area under the 3-person curve (steps 0, 10, 40-60; 0.2 at step 0, 0.4 + d after) differs from
    GRPO's by (10 x d / 2 + 50 x d) / 60 = 55 d / 60, +10.1 points; the accuracy is flat over steps 40-60, so every
    gain is 0 (p 1); the primary rows are not repeated."""
    from lopti_lab.studies.primary import secondary_markdown, secondary_table

    curves = _study((0.10, 0.11, 0.12), (-0.02, 0.0, 0.02), (-0.01, 0.01, 0.03))
    table = secondary_table(curves, curves).set_index(["measure", "method", "column"])
    first = "sampled, mean of steps 40, 50, 60"
    assert table.loc[(first, "GRPO+Lopti", "avg"), "mean"] == pytest.approx(0.06)
    assert (first, "GRPO+Lopti", "3ppl") not in table.index and (first, "GRPO+AR", "2ppl") in table.index
    auc = table.loc[("sampled, area under the curve", "GRPO+Lopti", "3ppl"), "mean"]
    assert auc == pytest.approx(55 * 0.11 / 60)
    gain = table.xs("sampled, gain from step 40 to 60", level="measure")
    assert (gain["mean"].abs() < 1e-12).all() and (gain["p"] == 1.0).all()
    assert len(table) == 4 * 2 * 3 - 3
    text = secondary_markdown(secondary_table(curves, curves))
    assert "| sampled, area under the curve | GRPO + Lopti | " in text and "+10.1 ± " in text
    assert "| sampled, mean of steps 40, 50, 60 | GRPO + Lopti | primary, above | primary, above | +6.0 ± " in text
