"""Ray, on a real local cluster of three one-core nodes (ray.cluster_utils, started once for the module):
tensor-parallel workers as Ray actors (--distributed-executor-backend ray) and data-parallel replicas as
a Ray Serve application (--data-parallel-backend ray), and their one-line refusals."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from minivllm import LLM
from minivllm.distributed.group import TensorParallelError
from tests.helpers import greedy
from tests.test_server import ServerProcess, scrape, start_server
from tests.test_tensor_parallel import TIGHT, TINY_PROMPTS, generate_tight, tiny_llama, tiny_reference  # noqa: F401


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A real Ray cluster of three one-core nodes on this host (they share its IP: ranks follow node
    ids), all on loopback, with small object stores and no dashboard."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback addresses only
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=80 << 20,
                                                                include_dashboard=False))
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_tp4_over_ray_equals_tp1_idles_and_fails_fast(ray_cluster: Any, tiny_llama: Path,
                                                      tiny_reference: tuple[list[list[int]], str]) -> None:
    """TP=4 with --distributed-executor-backend ray: three worker actors, one per node (one core each),
    ranks in node-id order from the driver's node; the same greedy tokens as TP=1; idle, the workers
    use (almost) no core; a killed actor ends the next step at once with a clear error."""
    import ray

    tp = LLM(model=str(tiny_llama), tensor_parallel_size=4, num_kv_blocks=9, distributed_executor_backend="ray", **TIGHT)
    # 2 query heads and a copy of one of the 2 KV heads per rank
    assert (tp.engine.runner.model.config.num_attention_heads, tp.engine.runner.model.config.num_key_value_heads) \
        == (2, 1)
    workers = tp.engine.runner.group.workers
    here = ray.get_runtime_context().get_node_id()
    assert len(set(workers.node_ids)) == 3 and workers.node_ids[0] == here
    assert workers.node_ids[1:] == sorted(workers.node_ids[1:])
    assert generate_tight(tp, TINY_PROMPTS, 20) == tiny_reference[0]
    assert tp.engine.scheduler.num_preemptions > 0

    before = [cpu_seconds(p) for p in workers.pids]
    time.sleep(3)
    idle = max(cpu_seconds(p) - b for p, b in zip(workers.pids, before)) / 3
    assert idle < 0.02, f"an idle worker used {idle:.1%} of a core"

    ray.kill(workers.actors[1])
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 2 \(Ray actor on node \w+\) died"):
        tp.generate([TINY_PROMPTS[0]], greedy(4), use_tqdm=False)
    assert time.monotonic() - start < 10
    tp.engine.close()
    deadline = time.monotonic() + 10  # the placement group's removal is asynchronous
    while ray.available_resources().get("CPU") != 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 3  # the bundles given back


def test_ray_refuses_a_size_the_cluster_cannot_place(ray_cluster: Any, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot place 7 tensor-parallel worker\(s\) of 1 CPU each .*7 CPU asked, "
                                           r"3 free on 3 node\(s\)"):
        LLM(model=str(tiny_llama), tensor_parallel_size=8, num_kv_blocks=9, distributed_executor_backend="ray", **TIGHT)


def test_ray_refuses_an_address_where_no_cluster_answers(tiny_llama: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # a port nobody listens on
    with pytest.raises(ValueError, match=f"no Ray cluster answers at {address} .*ray start --head"):
        LLM(model=str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=address,
            **TIGHT)



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_app(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """`minivllm serve --data-parallel-size 2 --data-parallel-backend ray`, as a user runs it against the
    cluster: one engine replica per node, one core each."""
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the replicas' share: their bundles' one CPU
    try:
        server = start_server(tmp_path_factory.mktemp("ray-serve") / "server.log", "--data-parallel-size", "2",
                              "--data-parallel-backend", "ray", "--ray-address", ray_cluster.address,
                              "--port", str(free_port()), "--quantization", "none")  # as the `llm` fixture
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    yield server
    assert server.stop() == 0, server.log.read_text()


def replica_names(server: ServerProcess) -> set[str]:
    return {r["replica"] for r in httpx.get(f"{server.url}/health").json()["replicas"] if r["healthy"]}


def test_serve_answers_as_one_engine_keeps_a_conversation_on_one_replica(serve_app: ServerProcess, llm: LLM) -> None:
    http = httpx.Client(base_url=serve_app.url + "/v1", timeout=120)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        served = http.post("/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"] == llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].text

    messages, served_by = [{"role": "system", "content": "You are a terse assistant. " * 8}], set()
    for question in ("Name a colour.", "And another one?", "Which of the two is darker?"):
        messages.append({"role": "user", "content": question})
        r = http.post("/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        served_by.add(r.headers["x-minivllm-replica"])
        messages.append(r.json()["choices"][0]["message"])
    assert len(served_by) == 1  # each turn's prompt starts with the last: it went where that prefix is

    names = replica_names(serve_app)
    assert len(names) == 2 and served_by <= names
    running = {key for key in scrape(serve_app.url) if key.startswith("minivllm:num_requests_running{")}
    assert running == {f"minivllm:num_requests_running{{replica={name}}}" for name in names}


def test_a_killed_serve_replica_is_replaced_and_its_stream_ends_with_an_error(serve_app: ServerProcess) -> None:
    import ray

    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", serve_app.url + "/v1/completions", json=body, timeout=120) as r:
        victim = r.headers["x-minivllm-replica"]
        actor = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].endswith("#" + victim))
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 4:
                ray.kill(ray.get_actor(actor, namespace="serve"))
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and "replica_failed" in events[-2], events[-3:]
    assert sum(line.startswith("data: {") for line in lines) < 400  # cut, not finished

    deadline = time.monotonic() + 60  # Serve starts another replica on the free node
    while (len(replica_names(serve_app)) != 2 or victim in replica_names(serve_app)) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = replica_names(serve_app)
    assert len(names) == 2 and victim not in names
    ok = httpx.post(serve_app.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.headers["x-minivllm-replica"] in names


def test_the_kuberay_manifest_builds_the_application() -> None:
    """deploy/kuberay-rayservice.yaml's Serve config names an importable builder and valid arguments."""
    import importlib

    import yaml

    manifest = yaml.safe_load((Path(__file__).parents[1] / "deploy/kuberay-rayservice.yaml").read_text())
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    module, name = app["import_path"].split(":")
    ingress = getattr(importlib.import_module(module), name)(app["args"])
    (engine,) = ingress._bound_deployment.init_args
    assert engine._bound_deployment.init_args[0][0] == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    assert engine._bound_deployment.init_args[1] == 4  # threads
    assert engine._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4
