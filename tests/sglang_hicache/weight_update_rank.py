"""One TP rank of an MLA model for test_sglang_weight_updates.py, in its own process as SGLang's
scheduler ranks are: `python weight_update_rank.py RANK INSTANCE RUN_DIR PORT`. Both ranks join
a gloo group (their TP CPU group), attach to the daemon, and run SGLang's weight updater with
no version; rank 0 (the storage writer) stores pages before and after, rank 1 finds and loads
them. Prints "rank N ok" when every check passed."""
from __future__ import annotations

import sys

import sglang_pools as sp
import sglang_updater as su
import torch.distributed as dist
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs


def main(rank: int, instance: str, run_dir: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    get_context().set_server_args(ServerArgs(model_path="test-org/test-model", device="cpu"))
    pool = sp.make_pool("mla", "page_first")
    sp.fill_random(pool, 1)  # MLA: every rank holds the same latent
    backend = sp.attach(pool, sp.extra_config(instance, run_dir), mla=True, tp_rank=rank, tp_size=2)
    keys = sp.page_hashes(4, seed=61)
    if rank == 0:
        assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3, 4])) == [True] * 4
    dist.barrier()
    assert backend.batch_exists(keys) == 4  # the control: rank 1 finds rank 0's pages
    dist.barrier()
    su.update_from_disk(su.updater(pool, group=dist.group.WORLD))
    assert backend.batch_exists(keys) == 0, "a page of the old weights is a hit"
    dist.barrier()  # both looked before rank 0 stores anew
    sp.fill_random(pool, 2)  # what the new weights compute, the same on both ranks
    if rank == 0:
        assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3, 4])) == [True] * 4
    dist.barrier()
    if rank == 1:
        assert backend.batch_exists(keys) == 4, "rank 1 misses what rank 0 stored after the update"
        want = [sp.page_bytes(pool, p) for p in (1, 2, 3, 4)]
        assert sp.page_bytes(pool, 9) != want[0]
        assert backend.batch_get_v1(keys, sp.pages_of(pool, [9, 10, 11, 12])) == [True] * 4
        assert [sp.page_bytes(pool, p) for p in (9, 10, 11, 12)] == want
    dist.barrier()
    backend.close()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
