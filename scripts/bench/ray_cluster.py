"""A local Ray cluster of N nodes with C CPUs each on this host, for benchmarks: prints its address, then
holds it until SIGTERM or Ctrl-C.   python scripts/bench/ray_cluster.py NODES CPUS"""
import os
import signal
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback addresses only
from ray.cluster_utils import Cluster  # noqa: E402

num_nodes, num_cpus = int(sys.argv[1]), int(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=num_cpus, include_dashboard=False,
                                                            object_store_memory=200 << 20))
for _ in range(num_nodes - 1):
    cluster.add_node(num_cpus=num_cpus, object_store_memory=200 << 20)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
signal.sigwait({signal.SIGINT, signal.SIGTERM})
cluster.shutdown()
