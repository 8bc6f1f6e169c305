"""One process of a job that reads packed batches per host (`axonn-jax launch --nprocs 2
--devices-per-proc 2 -- tests/data_hosts.py CONFIG.json OUT`): it reads and tokenizes only its
rows of every global batch, assembles global arrays with `jax.make_array_from_process_local_data`,
checks them against the whole batch (which each process also makes, only to check), gathers the
job's data state and checks that it restores exactly; it writes OUT/proc<i>.json (its rows, the
documents it read per batch, the gathered state)."""
import json
import pathlib
import sys

import numpy as np

GLOBAL_BATCH, SEQ_LEN, STEPS = 8, 16, 3


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(np.asarray(a[k]), b[k]) for k in b)


def main():
    config, out = json.loads(pathlib.Path(sys.argv[1]).read_text()), pathlib.Path(sys.argv[2])
    import axonn_jax

    axonn_jax.init_distributed()  # joins the job `axonn-jax launch` describes
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from axonn_jax.run import loader

    config = loader.DataConfig.from_dict(config)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    rows = loader.process_rows(sharding, GLOBAL_BATCH, SEQ_LEN)
    batches = loader.make_batches(config, SEQ_LEN, GLOBAL_BATCH)  # JAX's process index and count
    assert batches.rows == rows, (batches.rows, rows)
    whole = loader.make_batches(config, SEQ_LEN, GLOBAL_BATCH, rows=range(GLOBAL_BATCH))
    for _ in range(STEPS):
        arrays = loader.global_arrays(next(batches), sharding, GLOBAL_BATCH)
        assert all(a.shape == (GLOBAL_BATCH, SEQ_LEN) and not a.is_fully_addressable
                   for a in arrays.values())
        assert same(multihost_utils.process_allgather(arrays, tiled=True), next(whole))
    documents = batches.stats()["data_documents"]
    state = loader.gather_state(batches)
    restored = loader.make_batches(config, SEQ_LEN, GLOBAL_BATCH, rows=range(GLOBAL_BATCH))
    restored.set_state(state)
    assert same(next(restored), next(whole))
    (out / f"proc{jax.process_index()}.json").write_text(json.dumps(
        {"rows": [rows.start, rows.stop], "documents": documents, "state": state}))


if __name__ == "__main__":
    main()
