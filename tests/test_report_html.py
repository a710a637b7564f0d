"""report.html: the page `mrl report` writes beside report.png, its CSVs, and the page as headless Chromium renders it.

Three fake runs (grpo seeds 0 and 1, gdpo seed 0), two channels `a` and `b`, held-out at steps 0, 3 and 6: the
training panels are a, b, total and the held-out ones a, b, accuracy, six plots in all."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mrl.runs.report import Run, find_runs, make_report, report_figure, write_html_report
from mrl.runs.tracking import METRICS_FILE

RUNS = [("grpo", 0), ("grpo", 1), ("gdpo", 0)]
LABELS = ["grpo/seed0", "grpo/seed1", "gdpo/seed0"]
TITLES = ["train: a", "train: b", "train: total", "held-out: a", "held-out: b", "held-out: accuracy"]


def records(seed: int) -> list[dict]:
    """Step s logs a = s/2 + seed, b = -s, total = a + b and a loss; steps 0, 3, 6 the held-out a, b, accuracy."""
    out = []
    for step in range(7):
        record = {"step": step}
        if step:
            a, b = step / 2 + seed, -float(step)
            record |= {"reward/a/mean": a, "reward/b/mean": b, "reward/total/mean": a + b, "loss/policy": 0.25}
        if step % 3 == 0:
            record |= {"eval/a/mean": step / 6, "eval/b/mean": -1.0, "eval/accuracy": step / 12}
        out.append(record)
    return out


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A multirun dir as `mrl train -m` leaves it: a run dir per job with its metrics and its .hydra config."""
    root = tmp_path / "multirun"
    for job, (algo, seed) in enumerate(RUNS):
        run = root / f"{job}_{algo}_seed{seed}"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text(f"algo: {{name: {algo}}}\ntrainer: {{seed: {seed}}}\n")
        (run / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records(seed)))
    return root


def links(page: str) -> list[str]:
    """The hrefs of the Data list (plotly.js holds a few `<a href` of its own)."""
    return re.findall(r'<a href="([^"]+)"', page.split('<ul id="data">')[1])


def test_the_page_is_self_contained_and_links_a_csv_of_every_metric_per_run(sweep):
    png, table = make_report([sweep], smooth=2)
    html = sweep / "report.html"
    page = html.read_text()
    assert png == sweep / "report.png" and png.exists()
    assert re.search(r"<script[^>]*\bsrc=", page) is None  # plotly.js inline: it opens offline
    assert len(page) > 1_000_000 and "Plotly.newPlot" in page
    assert page.count("<table>") == 4 and "<td>grpo/seed1</td>" in page  # per run and per trainer, twice
    assert links(page) == ["report_data/grpo_seed0.csv", "report_data/grpo_seed1.csv", "report_data/gdpo_seed0.csv"]
    with (html.parent / links(page)[1]).open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["step", "eval/a/mean", "eval/b/mean", "eval/accuracy", "reward/a/mean", "reward/b/mean",
                             "reward/total/mean", "loss/policy"]
    assert [r["step"] for r in rows] == [str(s) for s in range(7)]
    assert rows[0]["reward/a/mean"] == "" and rows[0]["eval/accuracy"] == "0.0"  # step 0: the base model's eval only
    assert rows[3] == {"step": "3", "eval/a/mean": "0.5", "eval/b/mean": "-1.0", "eval/accuracy": "0.25",
                       "reward/a/mean": "2.5", "reward/b/mean": "-3.0", "reward/total/mean": "-0.5",
                       "loss/policy": "0.25"}  # seed 1: a = 3/2 + 1


def test_a_mean_per_trainer_with_its_band_and_a_curve_per_run_coloured_by_algo_and_dashed_by_seed(sweep):
    runs = find_runs([sweep])
    held_out = [("held-out: a", ["eval/a/mean"]), ("held-out: b", ["eval/b/mean"]),
                ("held-out: accuracy", ["eval/accuracy"])]
    fig = report_figure(runs, LABELS, ["a", "b", "total"], held_out, smooth=2)
    assert [a.text for a in fig.layout.annotations] == TITLES
    assert [t.name for t in fig.data if t.showlegend] == ["grpo mean ± SE", *LABELS]  # gdpo ran one seed: no mean
    on_a = [t for t in fig.data if "reward/a/mean" in (t.hovertemplate or "") or t.hoverinfo == "skip"][:5]
    upper, lower, mean, seed0, seed1 = on_a  # grpo's band edges, its mean, its runs
    # a = s/2 + seed, averaged over 2 steps: seed 0 0.5, 0.75, 1.25, ..., 2.75; seed 1 the same + 1
    assert list(seed1.y) == [1.5, 1.75, 2.25, 2.75, 3.25, 3.75] and list(seed1.customdata) == [1.5, 2, 2.5, 3, 3.5, 4]
    assert list(mean.y) == [1.0, 1.25, 1.75, 2.25, 2.75, 3.25]  # the mean of the two smoothed curves
    assert [se for se, _ in mean.customdata] == [0.5] * 6  # two seeds 1 apart: SE = 1 / 2
    assert list(upper.y) == list(seed1.y) and list(lower.y) == list(seed0.y) and lower.fill == "tonexty"
    assert all(part in seed1.hovertemplate for part in ("grpo/seed1", "step %{x}", "raw"))
    assert (seed0.opacity, seed1.opacity, mean.opacity) == (0.45, 0.45, None)  # the runs faint under the mean
    held = [t for t in fig.data if t.name == "gdpo/seed0" and "eval/accuracy" in (t.hovertemplate or "")]
    assert list(held[0].x) == [0, 3, 6] and list(held[0].y) == [0.0, 0.25, 0.5]  # unsmoothed
    style = {t.name: (t.line.color, t.line.dash) for t in fig.data if t.showlegend}
    assert style["grpo mean ± SE"][0] == style["grpo/seed0"][0] == style["grpo/seed1"][0] != style["gdpo/seed0"][0]
    assert style["grpo/seed0"][1] == style["gdpo/seed0"][1] != style["grpo/seed1"][1]  # a dash per seed
    menu = fig.layout.updatemenus[0].buttons
    assert [b.label for b in menu] == ["all runs", "grpo only", "gdpo only"]
    shown = menu[2].args[0]["visible"]
    assert {t.name for t, v in zip(fig.data, shown) if v is True} == {"gdpo/seed0"}


def test_write_html_report_names_a_repeated_label_apart(sweep, tmp_path):
    run = find_runs([sweep / "0_grpo_seed0"])[0]
    twin = Run(run.label, tmp_path / "elsewhere", run.records)  # the same algo and seed from another sweep
    page = write_html_report([run, twin], tmp_path / "out" / "agent.html").read_text()
    assert links(page) == ["agent_data/grpo_seed0.csv", "agent_data/grpo_seed0_2.csv"]
    assert "grpo/seed0 (2)" in page and all((tmp_path / "out" / link).exists() for link in links(page))


FALLBACK = "report_offline.html embeds plotly.js & opens offline."


def test_a_page_that_loads_plotly_from_the_cdn_holds_only_our_content(sweep, tmp_path):
    runs = find_runs([sweep])
    inline = write_html_report(runs, tmp_path / "inline.html").read_text()
    page = write_html_report(runs, tmp_path / "report.html", cdn_fallback=FALLBACK).read_text()
    assert re.findall(r'<script[^>]*\bsrc="([^"]+)"', page) == [
        re.search(r"https://cdn\.plot\.ly/plotly-[\d.]+\.min\.js", page).group()]
    assert len(page) < 40_000 < 1_000_000 < len(inline)  # plotly.js is the 4.5 MB; the curves and bands a few KB
    newplot = re.compile(r"Plotly\.newPlot\(.*?\)\s*};", re.S)
    assert newplot.findall(page) == newplot.findall(inline[inline.index('<div id="curves"'):])  # the same figure
    assert '<p id="no-plotly" hidden>' in page and "report_offline.html embeds plotly.js &amp; opens offline." in page
    assert links(page) == [f"report_data/{link.removeprefix('inline_data/')}" for link in links(inline)]


def chromium() -> str:
    """The headless browser; a skip without one, except in CI (CI=true), where the page must be checked."""
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        reason = "no chromium to render report.html in (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def headless(page: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """Open `page` in headless Chromium (a fresh profile under tmp_path) with `flags`, and return the run."""
    return subprocess.run(
        [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         *flags, "--virtual-time-budget=10000", page.as_uri()],
        capture_output=True, text=True, timeout=180)


def dump_dom(page: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """Open `page` in headless Chromium and return the run, its DOM as stdout."""
    return headless(page, tmp_path, *flags, "--dump-dom")


def test_the_page_renders_a_plot_per_panel_in_headless_chromium(sweep, tmp_path):
    make_report([sweep])
    html = sweep / "report.html"
    done = dump_dom(html, tmp_path, "--enable-logging=stderr", "--v=0")
    dom = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]  # uncaught errors land here
    assert console == []
    assert dom.count('class="main-svg"') >= 1  # plotly draws its svg only when the plot rendered
    assert len(re.findall(r'<g class="subplot x\d*y\d*"', dom)) == len(TITLES)
    assert re.findall(r'class="annotation-text"[^>]*data-unformatted="([^"]+)"', dom) == TITLES
    assert re.findall(r'class="legendtext"[^>]*data-unformatted="([^"]+)"', dom) == ["grpo mean ± SE", *LABELS]
    assert dom.count("<table>") == 4 and "<td>gdpo/seed0</td>" in dom
    hrefs = links(dom)
    assert len(hrefs) == len(RUNS) and all((html.parent / h).is_file() for h in hrefs)


# Clicks gdpo/seed0's legend entry (the 4th, after grpo's mean and seeds) as a user would (plotly listens for
# mousedown/mouseup), then hovers grpo/seed1's smoothed `a` curve at step 4; writes what plotly then holds and shows
# into the page for --dump-dom.
INTERACT = """<script>
setTimeout(function () {
  var gd = document.getElementById('curves');
  var entry = document.querySelectorAll('.legend .traces .legendtoggle')[3];
  ['mousedown', 'mouseup'].forEach(function (type) { entry.dispatchEvent(new MouseEvent(type, {bubbles: true})); });
  setTimeout(function () {
    var curve = gd.data.findIndex(function (d) {
      return d.name == 'grpo/seed1' && (d.hovertemplate || '').indexOf('reward/a/mean') >= 0; });
    Plotly.Fx.hover(gd, [{curveNumber: curve, pointNumber: 3}], 'xy');
    var out = document.createElement('pre');
    out.id = 'probe';
    out.textContent = JSON.stringify({
      visible: gd._fullData.map(function (d) { return [d.name, d.visible]; }),
      hover: Array.from(document.querySelectorAll('.hovertext text')).map(function (t) { return t.textContent; })});
    document.body.appendChild(out);
  }, 500);
}, 500);
</script></body>"""


def test_a_legend_click_hides_a_run_in_every_panel_and_hover_names_step_run_and_value(sweep, tmp_path):
    make_report([sweep], smooth=2)
    probe = sweep / "probe.html"  # a copy with the clicks: report.html itself carries no script of ours
    probe.write_text((sweep / "report.html").read_text().replace("</body>", INTERACT))
    dom = dump_dom(probe, tmp_path).stdout
    state = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    hidden = {name for name, visible in state["visible"] if visible == "legendonly"}
    assert hidden == {"gdpo/seed0"}  # all its 3 training and 3 held-out traces, and only those
    assert sum(name == "gdpo/seed0" for name, _ in state["visible"]) == 6
    assert state["hover"] == ["grpo/seed1step 4reward/a/mean: 2.75 (mean of 2)raw: 3"]  # a = 4/2 + 1; (2.5 + 3) / 2


def test_offline_the_cdn_page_says_so_and_still_shows_its_tables(sweep, tmp_path):
    html = write_html_report(find_runs([sweep]), tmp_path / "report.html", cdn_fallback=FALLBACK)
    # every host unresolvable: the CDN cannot answer, whatever network the machine has
    done = dump_dom(html, tmp_path, "--host-resolver-rules=MAP * ~NOTFOUND")
    dom = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert '<p id="no-plotly">' in dom and 'class="main-svg"' not in dom  # the note shown, no plot drawn
    assert dom.count("<table>") == 4 and "<td>gdpo/seed0</td>" in dom


# ---- the page as a person sees it: 2 algos x 2 seeds, 3 channels, the diagnostics and held-out, at 1000 and 1400 px

CHANNELS = ["correctness", "efficiency", "safety"]
DIAGNOSTIC_KEYS = ["adv/share/correctness", "adv/share/efficiency", "adv/share/safety", "groups/dead_frac",
                   "constraint/safety/violation_frac", "clip_frac", "entropy"]
WIDE_TITLES = ([f"train: {c}" for c in [*CHANNELS, "total"]] + DIAGNOSTIC_KEYS
               + [f"held-out: {c}" for c in CHANNELS] + ["held-out: accuracy"])


@pytest.fixture
def wide_sweep(tmp_path: Path) -> Path:
    """grpo and gdpo, seeds 0 and 1, 20 steps of every default panel's key, held-out every 5 steps."""
    root = tmp_path / "wide"
    for job, (algo, seed) in enumerate([("grpo", 0), ("grpo", 1), ("gdpo", 0), ("gdpo", 1)]):
        run = root / f"{job}_{algo}_seed{seed}"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text(f"algo: {{name: {algo}}}\ntrainer: {{seed: {seed}}}\n")
        lines = []
        for step in range(21):
            record = {"step": step} | ({f"eval/{c}/mean": step / 20 for c in CHANNELS} | {"eval/accuracy": 0.5}
                                       if step % 5 == 0 else {})
            if step:
                record |= {f"reward/{c}/mean": (step + seed) / 20 for c in [*CHANNELS, "total"]}
                record |= {k: 0.1 * (job + 1) for k in DIAGNOSTIC_KEYS}
            lines.append(json.dumps(record) + "\n")
        (run / METRICS_FILE).write_text("".join(lines))
    return root


# Writes into the page, once plotly has drawn: whether it scrolls sideways, the panels drawn, and the boxes of the
# legend, the toolbar, the menu and the panels, for --dump-dom.
LAYOUT = """<script>
setTimeout(function () {
  var box = function (el) { var r = el.getBoundingClientRect(); return [r.left, r.right]; };
  var out = document.createElement('pre');
  out.id = 'layout';
  out.textContent = JSON.stringify({
    scroll: document.documentElement.scrollWidth, client: document.documentElement.clientWidth,
    titles: Array.from(document.querySelectorAll('.annotation-text')).map(function (t) { return t.textContent; }),
    panels: Array.from(document.querySelectorAll('.draglayer .nsewdrag')).map(box),
    legend: box(document.querySelector('.legend')), modebar: box(document.querySelector('.modebar')),
    menu: box(document.querySelector('.updatemenu-container'))});
  document.body.appendChild(out);
}, 1500);
</script></body>"""


@pytest.mark.parametrize("width", [1000, 1400, 1600])
def test_from_1000_to_1600_px_the_page_fits_without_a_sideways_scroll_and_shows_every_panel(wide_sweep, tmp_path,
                                                                                           width):
    write_html_report(find_runs([wide_sweep]), wide_sweep / "report.html")
    probe = wide_sweep / "layout.html"
    probe.write_text((wide_sweep / "report.html").read_text().replace("</body>", LAYOUT))
    dom = dump_dom(probe, tmp_path, f"--window-size={width},900").stdout
    seen = json.loads(re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    assert seen["client"] >= width - 20 and seen["scroll"] <= seen["client"]  # no horizontal scrollbar
    assert seen["titles"] == WIDE_TITLES and len(seen["panels"]) == len(WIDE_TITLES)  # every panel, drawn
    right_of_panels = max(right for _, right in seen["panels"])
    assert right_of_panels <= seen["legend"][0] < seen["legend"][1] <= seen["client"]  # the legend outside, whole
    assert seen["modebar"][1] <= seen["client"] and seen["menu"][1] <= seen["client"]
    shot = tmp_path / f"report-{width}.png"
    done = headless(wide_sweep / "report.html", tmp_path, f"--window-size={width},2400", f"--screenshot={shot}")
    assert done.returncode == 0 and int.from_bytes(shot.read_bytes()[16:20], "big") == width  # PNG's IHDR width
