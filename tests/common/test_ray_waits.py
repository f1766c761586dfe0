"""What waits in a Ray cluster, in words: each waiting group named with the stage that asks for it, what the cluster
has, and why it waits (common.ray_waits; the watchdog prints these lines)."""

from common.ray_waits import Snapshot, Waiting, describe

GIB = 2**30


def _cluster(**free) -> Snapshot:
    total = {"CPU": 2.0, "memory": 16 * GIB, "object_store_memory": 4 * GIB, "node:10.0.0.1": 1.0}
    return Snapshot(total=total, free={**total, **free}, nodes=[dict(total)])


# --- on made-up clusters ----------------------------------------------------------------------------------------------


def test_a_missing_resource_is_named_with_the_stage_that_asks_for_it():
    snap = _cluster()
    snap.waiting = [Waiting(2, "task or actor", {"CPU": 0.5, "GPU": 1.0, "memory": 1.25 * GIB})]
    requests = {"stage decode": {"CPU": 0.5, "memory": 1.25 * GIB}, "stage person": {"CPU": 0.5, "GPU": 1.0,
                "memory": 1.25 * GIB}}  # fmt: skip
    lines = describe(snap, requests)
    assert lines[0].startswith("2 tasks or actors of stage person wait for {CPU: 0.5, GPU: 1, memory: 1.2 GiB}")
    assert "no GPU" in lines[0] and "no node has 1 GPU" in lines[0]
    assert (
        lines[-1]
        == "cluster: 1 node; 2 CPU (2 free), 16 GiB memory (16 GiB free), 4 GiB object_store_memory (4 GiB free)"
    )


def test_busy_resources_say_what_is_free_and_that_the_work_starts_when_freed():
    snap = _cluster(CPU=0.4)
    snap.waiting = [Waiting(3, "task", {"CPU": 1.0, "memory": 1.25 * GIB}, name="MapBatches(person)")]
    lines = describe(snap, {"stage person": {"CPU": 1.0, "memory": 1.25 * GIB}, "stage phash": {"CPU": 1.0,
                     "memory": 1.25 * GIB}})  # fmt: skip
    assert lines[0] == (
        "3 tasks of stage person (MapBatches(person)) wait for {CPU: 1, memory: 1.2 GiB}; the cluster has 2 CPU "
        "(0.4 free), 16 GiB memory (16 GiB free): they start when the running work frees CPU"
    )


def test_a_request_no_node_can_hold_is_named_before_ray_lists_it():
    """Ray Train's worker group before its placement group shows in the demand; a placement group's derived
    resources stay out of the cluster line."""
    snap = _cluster()
    snap.total["CPU_group_0_" + "ab" * 14] = snap.free["CPU_group_0_" + "ab" * 14] = 1.0
    lines = describe(snap, {}, {"the Ray Train worker group": {"CPU": 1.0, "GPU": 1.0}})
    assert lines[0].startswith("the Ray Train worker group asks for {CPU: 1, GPU: 1} each; the cluster has 2 CPU")
    assert "no node has 1 GPU" in lines[0]
    assert not any("nothing waits" in line for line in lines)
    assert "_group_" not in lines[-1]
    snap.waiting = [Waiting(2, "placement-group bundle", {"CPU": 1.0, "GPU": 1.0})]
    assert describe(snap, {}, {"the Ray Train worker group": {"CPU": 1.0, "GPU": 1.0}})[0].startswith(
        "2 placement-group bundles of the Ray Train worker group wait for {CPU: 1, GPU: 1}"
    )


def test_tasks_that_wait_on_what_a_worker_group_reserves_are_told_apart_from_busy_ones():
    """The README's pretraining stall: the workers hold every CPU and wait on Ray Data's read tasks, which need one."""
    snap = _cluster(CPU=0.0)
    snap.total["CPU_group_" + "cd" * 14] = snap.total["CPU_group_0_" + "cd" * 14] = 2.0
    snap.waiting = [Waiting(2, "task or actor", {"CPU": 0.5})]
    groups = {"the Ray Train worker group (ray.workers x ray.cpus_per_worker)": {"CPU": 1.0}}
    lines = describe(snap, {"the data reader (data.read_cpus)": {"CPU": 0.5}}, groups)
    assert lines[0] == (
        "2 tasks or actors of the data reader (data.read_cpus) wait for {CPU: 0.5}; the cluster has 2 CPU (0 free): "
        "placement groups of the Ray Train worker group (ray.workers x ray.cpus_per_worker) reserve 2 of the 2 CPU, "
        "leaving less than they need: if what runs inside them waits on these, nothing will free it (reserve less, or "
        "add CPU)"
    )


def test_nothing_waiting_points_at_the_work_itself():
    lines = describe(_cluster(), {"stage person": {"CPU": 0.5}})
    assert lines[0].startswith("nothing waits for cluster resources")
