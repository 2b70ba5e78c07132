"""Device probes against real files: a fake sysfs tree in tmp_path, and this machine."""
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlfp.cli import main
from dlfp.devices.detect import detect_profile
from dlfp.devices.energy import energy_report, unwrap
from dlfp.devices.probes import ProbeSet
from dlfp.devices.rapl import RaplProbe
from dlfp.devices.reading import Reading
from dlfp.devices.sampler import ProbeSampler
from dlfp.trace import RequestRecord, StepRecord, Trace

MAX_RANGE = 262143328850  # a real package domain's max_energy_range_uj


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}\n")
    return path


def laptop_tree(root, energy_uj=1000, battery_status="Discharging"):
    """A laptop's sysfs: two thermal zones, RAPL package + core, a battery, cpufreq, throttle counters."""
    write(root, "sys/class/thermal/thermal_zone0/type", "x86_pkg_temp")
    write(root, "sys/class/thermal/thermal_zone0/temp", 61500)
    write(root, "sys/class/thermal/thermal_zone1/type", "acpitz")
    write(root, "sys/class/thermal/thermal_zone1/temp", 45000)
    for name, dom in (("package-0", "intel-rapl:0"), ("core", "intel-rapl:0:0")):
        write(root, f"sys/class/powercap/{dom}/name", name)
        write(root, f"sys/class/powercap/{dom}/energy_uj", energy_uj)
        write(root, f"sys/class/powercap/{dom}/max_energy_range_uj", MAX_RANGE)
    bat = "sys/class/power_supply/BAT0"
    write(root, f"{bat}/capacity", 42)
    write(root, f"{bat}/status", battery_status)
    write(root, f"{bat}/current_now", 1_500_000)  # 1.5 A
    write(root, f"{bat}/voltage_now", 11_400_000)  # 11.4 V
    write(root, "sys/class/power_supply/AC/type", "Mains")
    write(root, "sys/class/power_supply/AC/online", 0 if battery_status == "Discharging" else 1)
    for cpu in (0, 1):
        write(root, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq", 2_400_000 + cpu * 400_000)
        write(root, f"sys/devices/system/cpu/cpu{cpu}/thermal_throttle/core_throttle_count", 3)
    return root


def by_source(readings):
    return {(r.probe, r.source): r for r in readings}


def test_fake_laptop_tree_is_read(tmp_path):
    root = laptop_tree(tmp_path)
    with ProbeSet(root) as probes:
        r = by_source(probes.read())
    assert r[("thermal", "thermal_zone0")].values == {"type": "x86_pkg_temp", "temp_c": 61.5}
    pkg = r[("rapl", "intel-rapl:0")].values
    assert pkg["domain"] == "package-0" and pkg["energy_uj"] == 1000 and pkg["top_level"]
    assert not r[("rapl", "intel-rapl:0:0")].values["top_level"]
    bat = r[("battery", "BAT0")].values
    assert bat["percent"] == 42 and bat["plugged"] is False
    assert bat["discharge_w"] == pytest.approx(1.5 * 11.4)
    cpu = r[("cpu", "cpu")]
    assert cpu.values["freq_mhz"] == pytest.approx(2600) and cpu.values["freq_max_mhz"] == pytest.approx(2800)
    assert cpu.values["throttle_count"] == 6 and cpu.values["throttling"] is False
    assert "util_pct" in cpu.missing  # psutil reads the live system only
    # NVML and hwmon talk to the live system, so a fake root says so.
    assert "root=" in r[("nvml", "nvml")].unavailable and "root=" in r[("hwmon", "hwmon")].unavailable


def test_throttle_counter_rise_reads_as_throttling(tmp_path):
    root = laptop_tree(tmp_path)
    with ProbeSet(root, families=("cpu",)) as probes:
        assert probes.read()[0].values["throttling"] is False
        write(root, "sys/devices/system/cpu/cpu1/thermal_throttle/core_throttle_count", 4)
        assert probes.read()[0].values["throttling"] is True
        assert probes.read()[0].values["throttling"] is False  # no rise since


def test_charging_battery_has_no_discharge_power(tmp_path):
    root = laptop_tree(tmp_path, battery_status="Charging")
    reading = ProbeSet(root, families=("battery",)).read()[0]
    assert reading.values["plugged"] is True
    assert "discharge_w" not in reading.values and "not discharging" in reading.missing["discharge_w"]


def test_unreadable_zone_and_garbage_do_not_raise(tmp_path):
    write(tmp_path, "sys/class/thermal/thermal_zone0/type", "acpitz")
    write(tmp_path, "sys/class/thermal/thermal_zone0/temp", "not-a-number")
    write(tmp_path, "sys/class/powercap/intel-rapl:0/name", "package-0")
    reading_t = ProbeSet(tmp_path, families=("thermal",)).read()[0]
    reading_r = ProbeSet(tmp_path, families=("rapl",)).read()[0]
    assert "not-a-number" in reading_t.unavailable
    assert "energy_uj" in reading_r.unavailable


def read_unprivileged(probe_cls, root):
    """Read a probe as an unprivileged user: as root, in a forked child that drops to nobody."""
    if os.geteuid() != 0:
        return probe_cls(root).read()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no exec, so the imported probe code runs as is
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps([asdict(x) for x in probe_cls(root).read()]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return [Reading(**x) for x in json.loads(data)]


def test_root_only_energy_file_gives_a_clear_reason():
    # Outside tmp_path: pytest's base folder is private to its user, and nobody must reach the tree.
    root = Path(tempfile.mkdtemp(prefix="dlfp-rapl-"))
    try:
        root.chmod(0o755)
        laptop_tree(root)
        (root / "sys/class/powercap/intel-rapl:0/energy_uj").chmod(0o400)  # as the kernel does since 5.10
        readings = by_source(read_unprivileged(RaplProbe, root))
    finally:
        shutil.rmtree(root)
    pkg = readings[("rapl", "intel-rapl:0")]
    assert not pkg.ok
    assert "root only" in pkg.unavailable and "CVE-2020-8694" in pkg.unavailable
    assert pkg.values["domain"] == "package-0"  # what could be read is kept
    assert readings[("rapl", "intel-rapl:0:0")].values["energy_uj"] == 1000  # a readable sibling still reads


def test_unwrap_and_energy_across_the_rapl_wraparound(tmp_path):
    assert unwrap([10, 20, 5], 25) == [0, 10, 20]
    root = laptop_tree(tmp_path)
    counter = root / "sys/class/powercap/intel-rapl:0/energy_uj"
    trace = Trace(origin=0.0)
    t = iter([0.0, 1.0, 2.0, 3.0])
    # 10 J per second; the counter passes max_energy_range_uj between the 2nd and 3rd reading.
    start = MAX_RANGE - 15_000_000
    values = [start, start + 10_000_000, (start + 20_000_000) - MAX_RANGE, (start + 30_000_000) - MAX_RANGE]
    sampler = ProbeSampler(trace, root=root, probes=ProbeSet(root, families=("rapl",)), clock=lambda: next(t))
    for v in values:
        counter.write_text(f"{v}\n")
        sampler.sample_once()
    report = energy_report(trace.samples, 0.0, 3.0)
    assert report["energy_source"] == "rapl"
    assert report["energy_j"] == pytest.approx(30.0)  # the package only: core is inside it
    assert report["energy_j"] == pytest.approx(energy_report(trace.samples, 0.5, 3.5)["energy_j"] + 5.0)


def test_energy_split_by_class_and_peak_temperature():
    samples = [{"t": float(t), "probe": "nvml", "source": "nvml:0", "energy_mj": 100_000 + 50_000 * t,
                "temp_c": 60.0 + t} for t in range(5)]  # 50 W
    steps = [
        StepRecord(0.0, 1.0, 1.0, 1, 0, 0, True, 8, None),  # foreground decode alone
        StepRecord(1.0, 2.0, 1.0, 0, 0, 100, False, None, 32),  # background prefill alone
        StepRecord(2.0, 3.0, 1.0, 1, 0, 20, True, 8, None),  # both
    ]
    requests = [
        RequestRecord("fg", "foreground", "", 0.0, 4, [1, 2], [1.0, 3.0], "length", None, 3.0),
        RequestRecord("bg", "background", "", 0.0, 120, [7], [4.0], "length", None, 4.0),
    ]
    rep = energy_report(samples, 0.0, 4.0, steps, requests)
    assert rep["energy_j"] == pytest.approx(200.0) and rep["output_tokens"] == 3
    assert rep["j_per_output_token"] == pytest.approx(200.0 / 3)
    pc = rep["per_class"]
    assert pc["foreground"]["energy_j"] == pytest.approx(50)
    assert pc["foreground"]["j_per_output_token"] == pytest.approx(50)
    assert pc["background"]["j_per_prompt_token"] == pytest.approx(0.5)
    assert pc["mixed"]["steps"] == 1 and pc["idle"]["energy_j"] == pytest.approx(50)
    assert rep["peak_temp_c"] == 64.0 and rep["peak_temp_source"] == "nvml:nvml:0"


def test_battery_discharge_is_integrated_when_there_is_no_counter():
    samples = [{"t": t, "probe": "battery", "source": "BAT0", "percent": 50.0, "plugged": False,
                "discharge_w": w} for t, w in ((0.0, 10.0), (2.0, 20.0))]
    samples.append({"t": 0.0, "probe": "rapl", "source": "rapl", "unavailable": "no RAPL"})
    rep = energy_report(samples, 0.0, 2.0)
    assert rep["energy_source"] == "battery" and rep["energy_j"] == pytest.approx(30.0)


def test_no_energy_source_says_why():
    samples = [{"t": 0.0, "probe": "rapl", "source": "rapl", "unavailable": "no /sys/class/powercap"}]
    rep = energy_report(samples, 0.0, 1.0, [], [])
    assert rep["energy_j"] is None and "no /sys/class/powercap" in rep["unavailable"]
    assert rep["j_per_output_token"] is None and "per_class" not in rep


def test_sampler_thread_feeds_the_trace(tmp_path):
    root = laptop_tree(tmp_path)
    trace = Trace(origin=0.0)
    with ProbeSampler(trace, period_s=0.02, root=root) as sampler:
        while sampler.ticks < 4:
            pass
    assert sampler.ticks >= 5  # start, at least 3 periodic ticks, stop
    zone = [s for s in trace.samples if s["source"] == "thermal_zone0"]
    assert len(zone) == sampler.ticks and all(s["temp_c"] == 61.5 for s in zone)
    assert all(zone[i]["t"] <= zone[i + 1]["t"] for i in range(len(zone) - 1))
    assert any(s["probe"] == "nvml" and "unavailable" in s for s in trace.samples)
    paths = trace.write(tmp_path / "out", "x")
    assert paths["samples"].exists()


def test_detect_profile_from_trees(tmp_path):
    laptop = laptop_tree(tmp_path / "laptop")
    d = detect_profile(laptop)
    assert d.profile == "cpu-laptop" and "a battery" in d.reason
    phone = tmp_path / "phone"
    write(phone, "system/build.prop", "ro.product.model=Pixel")
    write(phone, "sys/class/power_supply/battery/capacity", 80)
    assert detect_profile(phone).profile == "phone"
    assert detect_profile(laptop, override="h200").overridden
    with pytest.raises(ValueError, match="unknown device profile"):
        detect_profile(laptop, override="toaster")


def test_gpu_name_picks_the_gpu_profile():
    def gpu(name):
        return [Reading("nvml", "nvml:0", {"name": name})]

    assert detect_profile("/nonexistent", gpu("NVIDIA H200")).profile == "h200"
    assert detect_profile("/nonexistent", gpu("NVIDIA A100-SXM4-80GB")).profile == "a100-paper"
    assert "no profile of its own" in detect_profile("/nonexistent", gpu("Tesla T4")).reason


def test_probe_command_on_a_fake_tree(tmp_path):
    root = laptop_tree(tmp_path)
    res = CliRunner().invoke(main, ["probe", "--root", str(root)])
    assert res.exit_code == 0, res.output
    assert "61.5" in res.output and "package-0" in res.output and "profile: cpu-laptop" in res.output
    res = CliRunner().invoke(main, ["probe", "--json", "--root", str(root), "--profile", "phone"])
    out = json.loads(res.output)
    assert out["profile"] == {"profile": "phone", "reason": "chosen by flag", "overridden": True}
    assert {"probe": "thermal", "source": "thermal_zone1", "type": "acpitz", "temp_c": 45.0} in out["readings"]


def test_probe_command_on_this_machine():
    """Here (a VM without sensors or GPU) every sensor probe must say why it is unavailable."""
    res = CliRunner().invoke(main, ["probe", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    families = {r["probe"] for r in out["readings"]}
    assert families == {"cpu", "thermal", "hwmon", "rapl", "battery", "nvml"}
    for r in out["readings"]:
        if "unavailable" in r:
            assert len(r["unavailable"]) > 10
        else:  # what this machine does have must carry a value (no silent blanks)
            assert set(r) - {"probe", "source", "missing"}
    sensors = {r["probe"] for r in out["readings"] if r["probe"] != "cpu" and "unavailable" not in r}
    if not sensors:  # the development machine and CI: nothing but psutil's CPU figures
        assert out["profile"]["profile"] == "cpu-laptop"


def test_probe_command_rejects_bad_input(tmp_path):
    res = CliRunner().invoke(main, ["probe", "--profile", "toaster", "--root", str(tmp_path)])
    assert res.exit_code != 0 and "unknown device profile" in res.output
    res = CliRunner().invoke(main, ["probe", "--root", str(tmp_path / "missing")])
    assert res.exit_code != 0


def test_nvml_reads_only_the_visible_gpus():
    from dlfp.devices.nvidia import visible_indices

    class Nvml:
        def nvmlDeviceGetCount(self):
            return 4

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUUID(self, h):
            return f"GPU-{h}{h}{h}-uuid"

    n = Nvml()
    assert visible_indices(n, {}) == [0, 1, 2, 3]
    assert visible_indices(n, {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert visible_indices(n, {"CUDA_VISIBLE_DEVICES": "GPU-333,GPU-1"}) == [3, 1]
    assert visible_indices(n, {"CUDA_VISIBLE_DEVICES": "1,7,2"}) == [1]  # as CUDA: stops at a bad entry
    assert visible_indices(n, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_position_cost_probe_fits_the_step_cost_law_from_two_chunk_sizes():
    """The probe's fit recovers s, t and k from medians that follow the law exactly; one
    chunk size cannot separate s from t, which is why the probe runs two."""
    import importlib.util
    pytest.importorskip("llama_cpp")
    path = Path(__file__).resolve().parents[1] / "scripts" / "position_cost_probe.py"
    spec = importlib.util.spec_from_file_location("position_cost_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rows = [{"chunk": n, "mean_position": p + (n - 1) / 2, "decode_only_ms": 14.0,
             "chunk_beside_decode_ms": 14.0 + 17.0 + (n - 1) * 2.5 * (1 + 0.001 * (p + (n - 1) / 2))}
            for p in (16, 256, 768, 1536) for n in (4, 16)]
    got = probe.fit(rows)
    assert got["seq_ms"] == pytest.approx(17.0) and got["token_ms"] == pytest.approx(2.5)
    assert got["depth"] == pytest.approx(0.001) and max(map(abs, got["residual_ms"])) < 1e-9


def test_neighbour_start_probe_reads_the_itl_that_spans_each_start():
    """A start inside a guarded step on two threads is read with the reply's gap that spans
    it (a cut step's gap runs to its rerun's token); a start in a step on one thread, in an
    unguarded step or between replies is not one of the probe's cases."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "scripts" / "neighbour_start_probe.py"
    spec = importlib.util.spec_from_file_location("neighbour_start_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    def step(t0, t1, guarded=True, threads=2, cut_by=None):
        return StepRecord(t0=t0, t1=t1, duration_s=t1 - t0, n_decode=1, n_prefill_fg=0, n_prefill_bg=0 if cut_by else 8,
                          guarded=guarded, cap=8, bg_cap=None, threads=threads, n_prefill_cut=8 if cut_by else 0,
                          cut_by=cut_by, rule="model")

    steps = [step(0.0, 0.09), step(0.09, 0.215, cut_by="deadline"), step(0.215, 0.24, threads=1),
             step(0.24, 0.33, threads=1), step(0.33, 0.5, guarded=False)]
    gaps = [(0.09, 0.24), (0.24, 0.33)]
    got = probe.span_at(steps, gaps, 0.15)
    assert got["itl_ms"] == pytest.approx(150.0) and got["into_step_ms"] == pytest.approx(60.0)
    assert got["cut_by"] == "deadline" and got["n_prefill"] == 8
    assert probe.span_at(steps, gaps, 0.3) is None  # one thread
    assert probe.span_at(steps, gaps, 0.4) is None  # unguarded, between replies
    assert probe.span_at(steps, gaps, 0.05) is None  # no reply gap spans it
