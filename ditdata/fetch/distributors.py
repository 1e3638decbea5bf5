"""The runtime that img2dataset's pyspark and ray distributors run on during `ditdata fetch`.

img2dataset (1.47) does not configure either: its pyspark distributor takes the active
SparkSession (and otherwise builds a `local[processes]` one with 16 GB of driver memory
and the UI on every interface), and its ray distributor submits one `ray.remote` task
per shard to whatever `ray.init()` is in effect (starting a default one on first use).
`runtime(cfg)` puts the right one in place for the duration of the download:

- pyspark: the active session if the caller has one (spark-submit, a notebook), else a
  session we start (`--spark-master URL`, or `local[processes]` bound to 127.0.0.1 with
  no UI and quiet logs) and stop at the end. Spark needs Java; we look for it first.
- ray: the initialised Ray if there is one, else `ray.init(address=--ray-address)` or a
  local instance with `processes` CPUs, shut down at the end.

Only what we started is stopped. The executors run img2dataset's Downloader (wrapped by
ditdata.fetch.urls.GuardedDownloader), so they need ditkit and img2dataset installed, and they
write the shards straight into --out: a path every executor can write.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from ditdata.common.extras import missing_extra
from ditdata.config import FetchConfig
from ditdata.errors import DitdataError

LOCAL_HOST = "127.0.0.1"
SPARK_DRIVER_MEMORY = "2g"  # the driver only hands shard descriptions to the Python workers
RAY_OBJECT_STORE_BYTES = 256 * 2**20  # tasks carry the downloader and one shard's rows only


@contextlib.contextmanager
def runtime(cfg: FetchConfig):
    """The distributed runtime of cfg.distributor, running while the block runs (nothing
    for multiprocessing)."""
    check(cfg)
    if cfg.distributor == "multiprocessing":
        yield
        return
    start = _spark if cfg.distributor == "pyspark" else _ray
    with start(cfg):
        yield


def check(cfg: FetchConfig) -> None:
    """Fail early, in one line, when cfg.distributor cannot run here: its package is not
    installed, or (pyspark, no active session) there is no Java to start Spark with."""
    if cfg.distributor == "multiprocessing":
        return
    if importlib.util.find_spec(cfg.distributor) is None:
        raise missing_extra(f"--distributor {cfg.distributor}", "distributed",
                            ModuleNotFoundError(f"{cfg.distributor} is not installed"), error=DitdataError)
    if cfg.distributor == "pyspark" and "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        if SparkSession.getActiveSession() is not None:
            return
    if cfg.distributor == "pyspark":
        java_home()


def java_home() -> str:
    """The java that Spark will run: $JAVA_HOME/bin/java, else java on PATH; a one-line
    error naming how to install one when there is neither."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = Path(home, "bin", "java")
        if os.access(java, os.X_OK):
            return str(java)
        raise DitdataError(
            f"--distributor pyspark: JAVA_HOME={home} has no bin/java; point JAVA_HOME at a Java 17+ "
            "runtime (e.g. /usr/lib/jvm/default-java) or unset it to use java from PATH"
        )
    java = shutil.which("java")
    if java is None:
        raise DitdataError(
            "--distributor pyspark needs Java (17 or newer for pyspark 4), found neither JAVA_HOME nor java "
            "on PATH: apt-get install default-jre-headless (Debian/Ubuntu), or set JAVA_HOME to a JRE"
        )
    return java


@contextlib.contextmanager
def _spark(cfg: FetchConfig):
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        if cfg.spark_master and active.sparkContext.master != cfg.spark_master:
            raise DitdataError(
                f"--spark-master {cfg.spark_master}: a Spark session on {active.sparkContext.master} is "
                "already active in this process; drop --spark-master to use it, or stop it first"
            )
        yield active
        return
    local = cfg.spark_master is None or cfg.spark_master.startswith("local")
    builder = (
        SparkSession.builder.appName("ditdata-fetch")
        .master(cfg.spark_master or f"local[{cfg.processes}]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", SPARK_DRIVER_MEMORY)
        # one shard per task: a failed shard is img2dataset's to report, not Spark's to rerun
        .config("spark.task.maxFailures", "1")
    )
    env = {}
    if local:
        builder = (builder.config("spark.driver.host", LOCAL_HOST)
                   .config("spark.driver.bindAddress", LOCAL_HOST))
        # pyspark's workers run $PYSPARK_PYTHON (default: python3 on PATH); locally, ours
        env = {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": LOCAL_HOST}
    with _environ(env):
        try:
            spark = builder.getOrCreate()
        except Exception as e:  # the JVM did not start or the master is unreachable
            raise DitdataError(
                f"--distributor pyspark: cannot start a Spark session on {cfg.spark_master or 'local'} "
                f"({_first_line(e)})"
            ) from None
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


@contextlib.contextmanager
def _ray(cfg: FetchConfig):
    import ray

    if ray.is_initialized():
        yield
        return
    if cfg.ray_address:
        kwargs = {"address": cfg.ray_address}
    else:
        kwargs = {"num_cpus": cfg.processes, "include_dashboard": False, "_node_ip_address": LOCAL_HOST,
                  "object_store_memory": RAY_OBJECT_STORE_BYTES}
    try:
        ray.init(**kwargs, log_to_driver=True, logging_level="ERROR", configure_logging=True)
    except Exception as e:
        raise DitdataError(
            f"--distributor ray: cannot start or join Ray at {cfg.ray_address or 'a local instance'} "
            f"({_first_line(e)})"
        ) from None
    try:
        yield
    finally:
        ray.shutdown()


def _first_line(e: BaseException) -> str:
    """"Type: the message's first line": a JVM's or Ray's error carries its whole trace."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


@contextlib.contextmanager
def _environ(values: dict):
    """os.environ with VALUES set where the user has not set them, restored afterwards."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
