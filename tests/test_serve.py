"""dittrain/inference/serve.py and `dittrain serve`: generate() gives exactly the images of the command it
shows (run through the CLI), bad requests are messages, text runs get a prompt box, and a real
headless Chromium drives the page of a `dittrain serve` process end to end."""

from __future__ import annotations

import base64
import io
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from cliutil import dittrain, free_port, one_error_line
from storeutil import tiny_store
from test_sample import make_run, read_png

from ditdata.store import encode_array
from dittrain.config import ServeConfig
from dittrain.inference.serve import Request, Server

pytestmark = pytest.mark.usefixtures("one_thread")
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def class_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    return make_run(root / "run", tiny_store(root / "store"))  # 16 px, classes astronaut, chelsea, coffee


@pytest.fixture(scope="module")
def server(class_run) -> Server:
    # batch size 2 < images: ddpm's ancestral noise is drawn batch after batch, so it must match
    return Server(class_run, ServeConfig(device="cpu", batch_size=2, max_images=8), log=lambda line: None)


def run_shown_command(command: str, out: Path) -> list[np.ndarray]:
    """Run the page's `dittrain sample` line as it is (its --out moved to `out`): the singles."""
    args = shlex.split(command)
    assert args[:2] == ["dittrain", "sample"]
    i = args.index("--out")
    args[i + 1] = str(out / "shown.png")
    r = dittrain(*args[1:])
    assert r.exit_code == 0, r.output
    return [read_png(p) for p in sorted((out / "shown").glob("*.png"))]


def test_generate_gives_the_images_of_the_shown_command(server, tmp_path):
    out = server.generate(Request(choice="2", n=3, steps=4, cfg_scale=3.0, seed=None))
    assert out.ok, out.message
    assert out.images.shape == (3, 16, 16, 3) and out.images.dtype == np.uint8 and out.labels == (2, 2, 2)
    # a random seed is drawn and SHOWN: in the message and in the command
    assert isinstance(out.seed, int) and f"seed {out.seed} (drawn" in out.message
    args = shlex.split(out.command)
    for flag, value in (("--class", "2"), ("--n", "3"), ("--steps", "4"), ("--cfg", "3.0"), ("--sampler", "ddpm"),
                        ("--seed", str(out.seed)), ("--batch-size", "2"), ("--device", "cpu"),
                        ("--precision", "fp32")):
        assert args[args.index(flag) + 1] == value, (flag, out.command)
    singles = run_shown_command(out.command, tmp_path)
    assert len(singles) == 3 and all(np.array_equal(a, b) for a, b in zip(out.images, singles, strict=True))
    # the same request with that seed: the same images; the class matters
    again = server.generate(Request(choice="2", n=3, steps=4, cfg_scale=3.0, seed=out.seed))
    assert np.array_equal(again.images, out.images) and "drawn" not in again.message
    other = server.generate(Request(choice="chelsea", n=3, steps=4, cfg_scale=3.0, seed=out.seed))
    assert other.labels == (1, 1, 1) and not np.array_equal(other.images, out.images)
    # random classes (drawn with the seed) reproduce through the command too
    mixed = server.generate(Request(choice="random", n=4, steps=3, sampler="ddim", seed=11))
    assert "--class random" in mixed.command
    assert all(np.array_equal(a, b) for a, b in zip(mixed.images, run_shown_command(mixed.command, tmp_path / "r"),
                                                    strict=True))


@pytest.mark.parametrize("request_, needle", [
    (Request(choice="1", steps=0), "number of steps must be in 1..1000"),
    (Request(choice="1", steps=1001), "1..1000"),
    (Request(choice="1", steps=None), "give the number of steps"),
    (Request(choice="1", n=9), "--max-images"),
    (Request(choice="1", n=0), "number of images"),
    (Request(choice="1", steps=1), "at least 2 steps"),
    (Request(choice="7"), "out of range"),
    (Request(choice="zebra"), "unknown class"),
    (Request(choice="1", sampler="euler"), "does not fit"),
    (Request(choice="1", cfg_scale=float("inf")), "finite"),
    (Request(choice="1", seed=-1), "seed"),
    (Request(choice="1", seed=2.5), "whole number"),
])
def test_a_bad_request_is_a_message(server, request_, needle):
    out = server.generate(request_)
    assert not out.ok and out.command == "" and needle in out.message, out.message
    assert "\n" not in out.message


def test_class_page_offers_the_manifest_names(server):
    pytest.importorskip("gradio")
    from dittrain.inference.serve import build_app

    demo = build_app(server)
    by_id = {c.get("props", {}).get("elem_id"): c for c in demo.config["components"]}
    choices = [c[0] for c in by_id["class"]["props"]["choices"]]
    assert choices[:3] == ["0: astronaut", "1: chelsea", "2: coffee"] and choices[3].startswith("random")
    assert [c[1] for c in by_id["sampler"]["props"]["choices"]] == ["ddpm", "ddim", "dpm++", "unipc"]
    assert by_id["gallery"]["props"]["format"] == "png"  # lossless: the PNGs the command writes
    assert "prompt" not in by_id


class FakeEncoder:
    """A stand-in for the store's text encoder: a pooled embedding from the prompt's bytes."""

    def embed_text(self, prompts, tokens=False):
        import torch

        rows = [np.resize(np.frombuffer(p.encode(), np.uint8).astype(np.float32) / 128 - 1, 16) for p in prompts]
        return {"text_pooled": torch.from_numpy(np.stack(rows))}


def test_text_run_shows_a_prompt_box_and_reports_a_missing_encoder(tmp_path):
    text = {"model": "no-such-clip", "pretrained": str(tmp_path / "gone.pt"), "encoder": "no-such-clip",
            "pooled_dim": 16, "empty": {"text_pooled": encode_array(np.zeros(16, np.float16))}}
    store = tiny_store(tmp_path / "store", conditioning={"type": "text", "text": text}, text={"pooled": 16})
    run = make_run(tmp_path / "run", store, text_pooled_dim=16)
    notes = []
    missing = Server(run, ServeConfig(device="cpu"), log=notes.append)
    assert any("text encoder" in n for n in notes)  # said at startup; the server still starts
    out = missing.generate(Request(choice="a red fox", steps=2))
    assert not out.ok and "cannot load the store's text encoder" in out.message
    assert "write a prompt" in missing.generate(Request(choice=" ", steps=2)).message

    served = Server(run, ServeConfig(device="cpu"), text_encoder=FakeEncoder(), log=lambda line: None)
    a = served.generate(Request(choice="a red fox", n=2, steps=2, seed=1))
    b = served.generate(Request(choice="a cat", n=2, steps=2, seed=1))
    assert a.ok and a.images.shape == (2, 16, 16, 3) and not np.array_equal(a.images, b.images)
    assert shlex.split(a.command)[shlex.split(a.command).index("--prompt") + 1] == "a red fox"
    pytest.importorskip("gradio")
    from dittrain.inference.serve import build_app

    by_id = {c.get("props", {}).get("elem_id"): c for c in build_app(served).config["components"]}
    assert by_id["prompt"]["type"] == "textbox" and "class" not in by_id


def test_unconditional_flow_run_and_changed_weights(tmp_path):
    run = make_run(tmp_path / "run", tiny_store(tmp_path / "store", conditioning={"type": "none"}), objective="flow")
    served = Server(run, ServeConfig(device="cpu", max_steps=20), log=lambda line: None)
    assert served.samplers == ("euler", "heun", "sde", "dpm++", "unipc") and served.max_steps == 20
    out = served.generate(Request(n=2, steps=3, sampler="heun", seed=4))
    assert out.ok and "--cfg" not in out.command and "--class" not in out.command and out.labels is None
    assert all(np.array_equal(a, b) for a, b in zip(out.images, run_shown_command(out.command, tmp_path), strict=True))
    assert "--max-steps" in served.generate(Request(steps=21)).message
    # the run's weights change under the server (training goes on): the page says so
    ema = run / "ema.safetensors"
    os.utime(ema, ns=(ema.stat().st_atime_ns, ema.stat().st_mtime_ns + 10**9))
    assert "has changed since this server loaded it" in served.generate(Request(n=1, steps=2)).message


def test_startup_errors_are_one_line(class_run, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = dittrain("serve", "--ckpt", class_run, "--port", taken.getsockname()[1])
    assert "in use" in one_error_line(r.output)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "ema.safetensors" in one_error_line(dittrain("serve", "--ckpt", empty, "--port", free_port()).output)


# -----------------------------------------------------------------------------
# a `dittrain serve` process, stopped by a signal

# a child that starts with SIGINT ignored, as every process of a background job `cmd &` of a
# non-interactive shell does (a CI script's `pytest ... &`): Python then installs no KeyboardInterrupt
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def serve_process(run: Path, port: int, tmp_path: Path, *options: str, ignore_sigint: bool = False):
    """`dittrain serve` of `run` on 127.0.0.1:`port`, on the CPU, its stdout and stderr in one pipe; run
    with -X faulthandler, so that SIGABRT prints every thread's stack (stop_server, when it hangs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_TEMP_DIR": str(tmp_path / "gradio")}
    args = ["-X", "faulthandler", "-m", "dittrain.cli", "serve", "--ckpt", str(run), "--port", str(port),
            "--device", "cpu", *options]
    return subprocess.Popen([sys.executable, *(["-c", IGNORING_SIGINT] if ignore_sigint else []), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def stop_server(proc, sig: signal.Signals, timeout: float = 60) -> str:
    """Send `sig` to the server and wait for it to exit: the rest of its output. A server still
    there after `timeout` s fails the test with all it said, its signal masks (/proc: SigIgn,
    SigCgt) and every thread's stack (SIGABRT to its faulthandler), not with a bare timeout."""
    proc.send_signal(sig)
    try:  # a few seconds: gradio's close joins its server thread (5 s at most)
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pass
    try:  # how the server treats `sig`: ignored, caught (a handler), blocked, or the default action
        status = dict(line.split(":\t") for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                     if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
        how = [w for k, w in (("SigIgn", "ignored"), ("SigCgt", "caught"), ("SigBlk", "blocked"))
               if int(status[k], 16) >> (sig - 1) & 1] or ["default action"]
        masks = f"{sig.name} {', '.join(how)} there; " + " ".join(f"{k} {v}" for k, v in status.items())
    except (OSError, KeyError, ValueError):
        masks = "no /proc status"
    proc.send_signal(signal.SIGABRT)  # -X faulthandler: every thread's stack on stderr, then it ends
    try:
        rest = proc.communicate(timeout=20)[0]  # with what the first communicate() read
    except subprocess.TimeoutExpired:
        proc.kill()
        rest = proc.communicate()[0]
    pytest.fail(f"the server did not exit within {timeout:g} s of {sig.name} ({masks}); the rest of its "
                f"output, then its threads' stacks:\n{rest}")


def test_ctrl_c_stops_a_server_that_started_with_sigint_ignored(class_run, tmp_path):
    """serve catches SIGINT itself: Ctrl-C stops it even where it started ignored (the browser
    test's server hung there: SIGINT did nothing)."""
    pytest.importorskip("gradio")
    proc = serve_process(class_run, free_port(), tmp_path, ignore_sigint=True)
    try:
        assert proc.stdout.readline().startswith("serving DiT-T/4")
        assert proc.stdout.readline().startswith("open http://127.0.0.1:")
        rest = stop_server(proc, signal.SIGINT, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and rest.rstrip().endswith("stopped") and "Traceback" not in rest, rest


# -----------------------------------------------------------------------------
# a real browser


def _browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            pytest.skip(f"{path} is missing (apt-get install chromium chromium-driver)")
    pytest.importorskip("gradio")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def test_browser_generates_the_commands_images(class_run, tmp_path, monkeypatch):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not try to download a driver
    browser = _browser()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_process(class_run, port, tmp_path, "--batch-size", "3")
    watchdog = threading.Timer(180, proc.kill)  # a hung server fails the test instead of hanging it
    watchdog.start()
    try:
        first = proc.stdout.readline()
        assert first.startswith("serving DiT-T/4"), first
        assert proc.stdout.readline().startswith(f"open {url}/"), "no URL line"
        browser.get(url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "#class input")).click()
        wait.until(lambda b: b.find_element(By.CSS_SELECTOR, '#class li[aria-label="2: coffee"]')).click()
        steps = browser.find_element(By.CSS_SELECTOR, "#steps input")
        steps.clear()
        steps.send_keys("5")
        browser.find_element(By.ID, "generate").click()
        imgs = wait.until(lambda b: (found := b.find_elements(By.CSS_SELECTOR, "#gallery img")) and len(found) >= 4
                          and found)  # the default 4 images, in order
        command = wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "#command textarea").get_attribute("value"))
        # the page's images, as the browser fetches them
        shown = []
        for img in imgs:
            data = browser.execute_async_script(
                "const done = arguments[1]; fetch(arguments[0]).then(r => r.arrayBuffer()).then(b => "
                "done(btoa(String.fromCharCode(...new Uint8Array(b)))));", img.get_attribute("src"))
            shown.append(read_png(io.BytesIO(base64.b64decode(data))))
        args = shlex.split(command)
        assert args[args.index("--class") + 1] == "2" and args[args.index("--steps") + 1] == "5"
        assert args[args.index("--batch-size") + 1] == "3" and args[args.index("--seed") + 1] == "0"
        expected = run_shown_command(command, tmp_path)
        assert len(expected) == 4
        for a, b in zip(shown, expected, strict=True):
            assert np.array_equal(a, b)
        # a bad request is a message in the page, and the server goes on
        steps.clear()
        steps.send_keys("0")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda b: "number of steps must be in 1..1000" in b.find_element(By.TAG_NAME, "body").text)
        assert proc.poll() is None
        # nothing came from anywhere but the server (fonts, scripts, images)
        fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert fetched and all(u.startswith((url + "/", "data:", "blob:")) for u in fetched), fetched
    finally:
        browser.quit()
        try:
            rest = stop_server(proc, signal.SIGINT)  # Ctrl-C
        finally:
            watchdog.cancel()
    assert proc.returncode == 0 and rest.rstrip().endswith("stopped"), rest
    assert "Traceback" not in rest


