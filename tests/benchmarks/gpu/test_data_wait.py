"""Part data_wait of the GPU check curates person photos with the lite profile: the photos it names are shipped."""

from benchmarks.gpu.data_wait import PERSON_PHOTOS
from benchmarks.gpu.sizes import GPU, SMOKE
from generators.sample_pool import load_photos


def test_the_person_photos_are_package_photos_and_enough_for_each_mode():
    assert set(PERSON_PHOTOS) <= set(load_photos())
    assert max(GPU.data_photos, SMOKE.data_photos) <= len(PERSON_PHOTOS)
