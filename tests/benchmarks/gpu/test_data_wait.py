"""Part data_wait of the GPU check curates person photos with the lite profile: the photos it names are shipped."""

from benchmarks.gpu.data_wait import PERSON_PHOTOS
from benchmarks.gpu.sizes import GPU, SMOKE
from generators.sample_pool import load_photos


def test_the_person_photos_are_package_photos_and_enough_for_each_mode():
    assert set(PERSON_PHOTOS) <= set(load_photos())
    assert max(GPU.data_photos, SMOKE.data_photos) <= len(PERSON_PHOTOS)


def test_the_pool_holds_the_batches_asked_for_in_distinct_files_of_the_same_pictures():
    import hashlib
    import io

    from PIL import Image

    from benchmarks.gpu.data_wait import pool_photos

    base = pool_photos(SMOKE, at_least=1)
    assert len(base) == SMOKE.data_photos * len(SMOKE.data_sizes)
    pool = pool_photos(SMOKE, at_least=2 * len(base) + 1)
    assert len(pool) == 3 * len(base) and pool[: len(base)] == base
    assert len({hashlib.sha256(b).digest() for b in pool}) == len(pool)  # no exact duplicate to drop
    for i, data in enumerate(pool):
        assert Image.open(io.BytesIO(data)).size == Image.open(io.BytesIO(base[i % len(base)])).size
