"""How many unrelated pairs the link rule would link by chance at the pool's N, estimated from the run's own data.

A bound of ``dedup.max_chance_fraction`` = 1e-4 chance links per survivor at 10^9 survivors is ~2e-13 per pair of
the pool, or ~1e-8 per pair compared inside an embedding cluster: far below what a sample of pairs shows directly.
So each population of pairs a region is searched in is measured on a sample, and the rare tail is extrapolated
from its observable bulk:

- measured (``measure``, in the embedding plan's task, on its uniform sample of survivors): the pHash distances of
  ``chance_pairs`` random pairs (the population of the pHash-alone region: every pair of the pool), and the joint
  histogram of (cosine, pHash distance) of random pairs of sample rows that share a home cluster, each cluster's
  pairs weighted to the pairs the search compares there (its share of N, squared, times the rows per survivor the
  plan predicts; the home-probe comparisons counted as home-home ones);
- the pHash-alone region: ``pairs x P(d <= r)``; a joint region (``c >= t``, ``d <= r``): ``W(c >= t) x
  P(d <= r | c >= t)``, with ``W`` the unrelated compared pairs at ``c >= t``; a region on the crop distance: that
  times the PDQ comparisons one crop distance makes (``link_rule.comparisons``: 65 with 32 sub-crops), a union
  bound that holds when each sub-crop's hash is spread over unrelated pairs like the whole image's (measured on real
  photos: ``benchmarks/dedup_truth.py`` prints both) and errs high where the sub-crops' hashes, which overlap, agree;
- both from the pairs *beyond* the region's configured radius, where the real copies mostly are not (99% of the copies of
  each kind measured by ``benchmarks/dedup_truth.py`` sit within 22 pHash bits, crops within 28, and within 58 of PDQ
  crop distance): a normal fitted by maximum likelihood to the distances above the radius (left-truncated, binned)
  gives ``P(d <= r)``, and the pairs beyond
  the radius divided by the normal's share there give the unrelated pairs of the population, so the copies inside
  it, a visible share of the pairs at high cosine in small pools or pools with many copies, are never counted as
  chance. The normal, because its tail is no lighter than the binomial of independent bits of the same spread (on
  uniform 48-bit hashes it overestimates the binomial 2x at 8 bits, 20x at 3). A joint region fits on the pairs at
  ``c >= t``, or, where fewer than ``MIN_FIT_PAIRS`` of them lie beyond its radius, on the highest cosine that has
  them (a crop region on the same pairs' PDQ distances, measured beside); one sampled pair's weight is added to
  ``W``, so that an unseen population never counts as empty. A region wide enough to hold nearly its whole
  population (few pairs beyond it) counts all its pairs, copies included.

Assumptions, and where they are checked. (1) Unrelated pairs' pHash distances, at each cosine, have a lower tail no
heavier than that normal: counted against brute force where chance links are common (``tests``: 24-bit hashes,
random and balanced), and on the benchmark at 200k survivors with 48 random pHash bits, half of them set (the
chance density of a ~10^9 pool of real 64-bit pHashes), where the previous rule's chance links at radius 8 are
observable (``benchmarks/bench_scale.py --previous-rule`` prints the estimate beside the pairs counted). Real
photos hash alike more often than the normal says where pictures are flat or dark (``benchmarks/RESULTS.md``).
(2) A sampled pair of a cluster stands for the cluster's
pairs: the sample is uniform.

Sizes at 10^9 survivors: the plan task already holds its sample (500k rows) and the centroids (44,700); the
measure assigns the sample to them (8.6e12 flops at 384-d, a tenth of the k-means it runs), draws ``chance_pairs``
random pairs and at most ``MAX_PAIRS_PER_CLUSTER`` pairs per cluster (~11 sample rows each: ~2.5M pairs), and writes
histograms of 65 (pHash) and 257 (PDQ) x 200 cells; the driver reads them and fits each region in milliseconds.

``fit_radii`` (the default) lowers the regions' radii until their estimates sum to at most the bound
(``fit_radii_within``: each its even share, then what the others left, a bit at a time; a region that cannot take
even radius 0 is turned off), so the rule a run uses depends on its N, as the chance rate does. Otherwise the configured radii are used, and a total above the
bound stops the phase with one line naming the setting (``ChanceBoundError``) unless ``dedup.allow_chance``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup.link_rule import (
    HASH_BITS,
    NO_PDQ,
    PDQ_BITS,
    PDQ_WORDS,
    LinkRule,
    Region,
    comparisons,
    crop_distances,
    pair_distances,
)

MIN_FIT_PAIRS = 50  # sampled pairs a population needs beyond a region before its spread is fitted
MIN_BEYOND_SHARE = 0.05  # below this share of a population beyond a region, its unrelated pairs are all its pairs
MIN_BOUND = 0.5  # chance links the bound allows in the whole run, however small the pool
RANDOM_PAIRS = 4_000_000  # random pairs whose pHash distances are measured (dedup.chance_pairs)
COSINE_BINS = 200  # histogram bins over [-1, 1]: 0.01 wide
MAX_PAIRS_PER_CLUSTER = 20_000  # sampled pairs of one cluster's sample rows, at most
ODD_SHARE = 0.01  # at most this share of sampled distances odd: the hashes are balanced, distances even (``Tail``)


class ChanceBoundError(RuntimeError):
    """The link rule's expected chance links exceed the bound (its message names the setting to change)."""


@dataclass(frozen=True)
class PdqSample:
    """The sample rows' PDQs as (rows, 4) uint64 words, whether each is set, and the sub-crop PDQs per survivor."""

    words: np.ndarray
    valid: np.ndarray
    crop_count: int = 0

    @classmethod
    def none(cls, rows: int) -> PdqSample:
        return cls(np.zeros((rows, PDQ_WORDS), np.uint64), np.zeros(rows, bool))


@dataclass(frozen=True)
class ChanceSample:
    """What ``measure`` finds in a sample; small (two histograms), so the driver holds it."""

    survivors: int
    hashed_pairs: float  # pairs of the pool where both have a pHash
    global_hist: np.ndarray  # (65,) sampled random pairs by pHash distance
    cluster_raw: np.ndarray  # (COSINE_BINS, 65) sampled same-cluster pairs by cosine bin and distance
    cluster_weighted: np.ndarray  # the same, each pair weighted to the compared pairs it stands for
    crop_count: int = 0  # sub-crop PDQs per survivor (0: none stored)
    # the same pairs where both have a PDQ, by cosine bin and PDQ distance (COSINE_BINS, 257): the crop regions'
    pdq_raw: np.ndarray | None = None
    pdq_weighted: np.ndarray | None = None

    def to_json(self) -> dict:
        return {
            "survivors": self.survivors,
            "crop_count": self.crop_count,
            "hashed_pairs": self.hashed_pairs,
            "global_hist": self.global_hist.tolist(),
            "cluster_raw": self.cluster_raw.tolist(),
            "cluster_weighted": self.cluster_weighted.tolist(),
            "pdq_raw": None if self.pdq_raw is None else self.pdq_raw.tolist(),
            "pdq_weighted": None if self.pdq_weighted is None else self.pdq_weighted.tolist(),
        }

    @classmethod
    def from_json(cls, d: dict) -> ChanceSample:
        return cls(
            int(d["survivors"]),
            float(d["hashed_pairs"]),
            np.asarray(d["global_hist"], np.int64),
            np.asarray(d["cluster_raw"], np.int64),
            np.asarray(d["cluster_weighted"], np.float64),
            int(d.get("crop_count", 0)),
            None if d.get("pdq_raw") is None else np.asarray(d["pdq_raw"], np.int64),
            None if d.get("pdq_weighted") is None else np.asarray(d["pdq_weighted"], np.float64),
        )


def _cosine_bin(c: np.ndarray) -> np.ndarray:
    return np.clip(np.floor((np.asarray(c, np.float64) + 1) * (COSINE_BINS / 2)), 0, COSINE_BINS - 1).astype(np.int64)


def _bin_of_threshold(t: float) -> int:
    """The first cosine bin a threshold takes whole or in part (conservative: the bin holding ``t`` counts)."""
    return int(_cosine_bin(np.asarray([t]))[0])


def measure(
    n: int,
    hashes: np.ndarray,
    hashed: np.ndarray,
    x: np.ndarray,
    home: np.ndarray,
    rows_per_survivor: float,
    pairs: int,
    seed: int,
    pdq: PdqSample | None = None,
) -> ChanceSample:
    """The sample's histograms: ``hashes`` (uint64) with ``hashed`` (bool: the pHash is set), unit embeddings ``x``
    and the ``home`` cluster of each of the ``s`` sample rows of a pool of ``n`` survivors, and their PDQs (``pdq``,
    none when not given)."""
    rng = np.random.default_rng([seed, 7])
    s = len(hashes)
    global_hist = np.zeros(HASH_BITS + 1, np.int64)
    with_hash = np.flatnonzero(hashed)
    if with_hash.size >= 2:
        m = min(pairs, with_hash.size * (with_hash.size - 1) // 2)
        i = rng.integers(0, with_hash.size, m)
        j = (i + rng.integers(1, with_hash.size, m)) % with_hash.size  # j != i, uniform over the others
        global_hist = np.bincount(pair_distances(hashes[with_hash[i]], hashes[with_hash[j]]), minlength=HASH_BITS + 1)
    share = with_hash.size / max(s, 1)
    hashed_pairs = (n * share) * (n * share - 1) / 2

    pdq = pdq if pdq is not None else PdqSample.none(s)
    raw = np.zeros((COSINE_BINS, HASH_BITS + 1), np.int64)
    weighted = np.zeros((COSINE_BINS, HASH_BITS + 1), np.float64)
    pdq_raw = np.zeros((COSINE_BINS, PDQ_BITS + 1), np.int64)
    pdq_weighted = np.zeros((COSINE_BINS, PDQ_BITS + 1), np.float64)
    order = np.argsort(home, kind="stable")
    bounds = np.flatnonzero(np.diff(home[order])) + 1
    for members in np.split(order, bounds) if order.size else []:
        k = members.size
        if k < 2:
            continue
        if k * (k - 1) // 2 <= MAX_PAIRS_PER_CLUSTER:
            i, j = np.triu_indices(k, 1)
        else:  # a large cluster: random pairs of distinct rows (never all k^2 / 2 of them in memory)
            i = rng.integers(0, k, MAX_PAIRS_PER_CLUSTER)
            j = (i + rng.integers(1, k, MAX_PAIRS_PER_CLUSTER)) % k
        a, b = members[i], members[j]
        cosine_bin = _cosine_bin(np.einsum("ij,ij->i", x[a], x[b]))
        # the cluster's members in the pool (its share of the sample, scaled to N) and the pairs compared there
        size = n * k / s
        weight = size * (size - 1) / 2 * rows_per_survivor / i.size
        # a pair without the hash a region measures is never linked by it: not counted
        for into_raw, into_weighted, has, distance in (
            (raw, weighted, hashed, lambda a, b: pair_distances(hashes[a], hashes[b])),
            (pdq_raw, pdq_weighted, pdq.valid, lambda a, b: crop_distances(pdq.words[a], [], pdq.words[b], [])),
        ):
            both = has[a] & has[b]
            cell = cosine_bin[both] * into_raw.shape[1] + distance(a[both], b[both])
            counts = np.bincount(cell, minlength=into_raw.size).reshape(into_raw.shape)
            into_raw += counts
            into_weighted += counts * weight
    return ChanceSample(n, float(hashed_pairs), global_hist, raw, weighted, pdq.crop_count, pdq_raw, pdq_weighted)


@dataclass(frozen=True)
class Tail:
    """The normal of the unrelated pairs' pHash distances, fitted to the distances beyond ``above`` (a region's own
    radius: inside it sit the real copies, outside it nearly only unrelated pairs).

    ``step`` is 2 where the distances are all even: ``imagehash.phash`` sets the bits above the median of its 64
    coefficients, so every hash has 32 ones and two hashes differ in an even number of bits. Each even distance then
    takes the normal's mass of two bits, ``[d - 1, d + 1]``; read bit by bit, the estimate at an even radius would
    be about half the rate (2x at 8 bits on real photos' spread)."""

    mean: float
    sd: float
    above: int
    pairs: int  # sampled pairs beyond ``above`` it was fitted on
    min_cosine: float | None  # the population: pairs at >= this cosine (None: every pair)
    step: int = 1

    @classmethod
    def fit(cls, hist: np.ndarray, above: int, min_cosine: float | None) -> Tail:
        """Maximum likelihood of the binned, left-truncated normal (scipy): bins ``above + 1 ..`` of ``hist`` (one per
        distance, 0 to the hash's bits)."""
        from scipy.optimize import minimize
        from scipy.special import ndtr

        hist = np.asarray(hist, np.float64)
        d = np.arange(hist.size, dtype=np.float64)
        bits = hist.size - 1
        step = 2 if hist.sum() > 0 and hist[1::2].sum() <= ODD_SHARE * hist.sum() else 1
        counts = np.where(d > above, hist, 0.0)
        total = counts.sum()
        if total <= 0:
            return cls(float(bits / 2), float(bits), above, 0, min_cosine, step)
        lo = (d - step / 2)[counts > 0]
        hi, n = lo + step, counts[counts > 0]
        edge = _lattice(above, step) + step / 2  # where the kept bins start

        def nll(theta: np.ndarray) -> float:
            mean, sd = theta[0], math.exp(theta[1])
            kept = max(1.0 - float(ndtr((edge - mean) / sd)), 1e-300)
            p = np.maximum(ndtr((hi - mean) / sd) - ndtr((lo - mean) / sd), 1e-300)
            return float(-(n * np.log(p / kept)).sum())

        start_mean = float((d * counts).sum() / total)
        start_sd = math.sqrt(max(float((counts * (d - start_mean) ** 2).sum() / total), 1.0))
        best = minimize(nll, np.array([start_mean, math.log(start_sd)]), method="Nelder-Mead")
        # the spread may not shrink below one bit (a single bin, or all pairs at one distance)
        return cls(float(best.x[0]), max(math.exp(float(best.x[1])), 1.0), above, int(total), min_cosine, step)

    def p_within(self, radius: int) -> float:
        """P(d <= radius) under the fitted normal."""
        if radius < 0:
            return 0.0
        edge = _lattice(radius, self.step) + self.step / 2
        return 0.5 * math.erfc(-((edge - self.mean) / self.sd) / math.sqrt(2))


def _lattice(radius: int, step: int) -> int:
    """The largest distance ``<= radius`` that occurs: every one, or every even one."""
    return radius - radius % step


@dataclass(frozen=True)
class RegionEstimate:
    region: Region
    pairs: float  # unrelated compared pairs of the region's population (at its cosine), inferred from beyond it
    tail: Tail

    def expected(self, radius: int) -> float:
        return self.pairs * self.tail.p_within(radius)

    def fit_radius(self, allowed: float) -> int:
        """The largest radius up to the region's own whose estimate is within ``allowed`` (-1: none)."""
        best = -1
        for r in range(self.region.radius + 1):
            if self.expected(r) <= allowed:
                best = r
        # on even distances an odd radius links no more than the even one below it, and would read wider
        return _lattice(best, self.tail.step) if best >= 0 else -1


def _unrelated(weighted: np.ndarray, above: int, tail: Tail) -> float:
    """The population's unrelated pairs, from its weighted distance histogram: those beyond ``above`` scaled up by
    the normal's share there; where that share is small (a region wide enough to take in most of the population),
    every pair, copies included."""
    share = 1 - tail.p_within(above)
    if share < MIN_BEYOND_SHARE:
        return float(weighted.sum())
    return float(weighted[above + 1 :].sum()) / share


def region_estimate(sample: ChanceSample, region: Region) -> RegionEstimate:
    """The unrelated pairs of the region's population and their fitted distances; the population's pairs within the
    region's radius are not counted (copies sit there), but inferred from those beyond through the fitted normal."""
    above = max(region.radius, 0)
    if region.min_cosine is None:
        fit_above = above if sample.global_hist[above + 1 :].sum() >= MIN_FIT_PAIRS else -1
        tail = Tail.fit(sample.global_hist, fit_above, None)
        hist = sample.global_hist.astype(np.float64)
        pairs = _unrelated(hist, above, tail) / max(hist.sum(), 1) * sample.hashed_pairs
        return RegionEstimate(region, pairs, tail)
    first = _bin_of_threshold(region.min_cosine)
    raw, weighted_all = sample.cluster_raw, sample.cluster_weighted
    if region.crops:  # the crop distance's comparisons are PDQ's (an older plan without them: none measured)
        raw = sample.pdq_raw if sample.pdq_raw is not None else np.zeros((COSINE_BINS, NO_PDQ), np.int64)
        weighted_all = sample.pdq_weighted if sample.pdq_weighted is not None else raw.astype(np.float64)
    fit_from = first
    while fit_from > 0 and raw[fit_from:, above + 1 :].sum() < MIN_FIT_PAIRS:
        fit_from -= 1
    population = raw[fit_from:].sum(axis=0)
    fit_above = above if population[above + 1 :].sum() >= MIN_FIT_PAIRS else -1  # too few beyond: fit on them all
    tail = Tail.fit(population, fit_above, round(fit_from * 2 / COSINE_BINS - 1, 2))
    mean_weight = sample.cluster_weighted.sum() / max(sample.cluster_raw.sum(), 1)
    weighted = weighted_all[first:].sum(axis=0)
    # one sampled pair's weight added: an unseen population never counts as empty
    pairs = _unrelated(weighted, above, tail) + mean_weight
    # a crop distance is the least of several hash comparisons per pair: count each (the module's union bound)
    return RegionEstimate(region, pairs * (comparisons(sample.crop_count) if region.crops else 1), tail)


@dataclass(frozen=True)
class ChanceEstimate:
    """The rule a run uses and its expected chance links."""

    rule: LinkRule  # with the radii the run uses
    configured: LinkRule
    estimates: tuple[RegionEstimate, ...]
    bound: float
    survivors: int
    allowed: bool  # over the bound, and dedup.allow_chance let it proceed

    @property
    def expected(self) -> float:
        return float(sum(e.expected(r.radius) for e, r in zip(self.estimates, self.rule.regions)))

    def summary(self) -> dict:
        """The record of the phase and the card: the rule, per region the radius and estimate, the total."""
        regions = []
        for e, used, configured in zip(self.estimates, self.rule.regions, self.configured.regions):
            regions.append(
                {
                    "region": configured.describe(),
                    "radius": used.radius,
                    "configured_radius": configured.radius,
                    "expected_chance_links": float(f"{e.expected(used.radius):.3g}"),
                    "population_pairs": float(f"{e.pairs:.3g}"),
                    "fit": {
                        "mean": round(e.tail.mean, 2),
                        "sd": round(e.tail.sd, 2),
                        "step": e.tail.step,
                        "beyond": e.tail.above,
                        "sampled_pairs": e.tail.pairs,
                        "min_cosine": e.tail.min_cosine,
                    },
                }
            )
        return {
            "rule": self.rule.describe(),
            "survivors": self.survivors,
            "expected_chance_links": float(f"{self.expected:.3g}"),
            "per_survivor": float(f"{self.expected / max(self.survivors, 1):.3g}"),
            "bound": float(f"{self.bound:.3g}"),
            "allowed_over_bound": self.allowed,
            "regions": regions,
        }

    def line(self) -> str:
        return (
            f"[dedup] link rule at N={self.survivors}: {self.rule.describe()}; expected chance links "
            f"{self.expected:.3g} ({self.expected / max(self.survivors, 1):.2g} per survivor, bound {self.bound:.3g})"
        )


def _share(estimates: tuple[RegionEstimate, ...], bound: float) -> float:
    """The even share of the bound of each region that is on."""
    return bound / max(sum(e.region.radius >= 0 for e in estimates), 1)


def fit_radii_within(estimates: tuple[RegionEstimate, ...], bound: float) -> list[int]:
    """Radii, each at most its region's, whose estimates sum to at most ``bound``: each region first gets the largest
    radius within an even share of the bound (the tails are steep: a shared budget in bits would go to the region
    whose estimate grows slowest), then what the others left is spent widening them one distance at a time (two bits
    where distances are even), in turn."""
    share = _share(estimates, bound)
    radii = [e.fit_radius(share) if e.region.radius >= 0 else -1 for e in estimates]
    total = sum(e.expected(r) for e, r in zip(estimates, radii))
    grown = True
    while grown:
        grown = False
        for k, e in enumerate(estimates):
            r = radii[k] + (e.tail.step if radii[k] >= 0 else 1)  # the next distance that occurs
            if r > e.region.radius:
                continue
            cost = e.expected(r) - e.expected(radii[k])
            if total + cost <= bound:
                radii[k], total, grown = r, total + cost, True
    return radii


def decide(
    sample: ChanceSample,
    configured: LinkRule,
    max_fraction: float,
    *,
    fit_radii: bool = True,
    allow: bool = False,
) -> ChanceEstimate:
    """The radii the run uses and their estimate; raises ``ChanceBoundError`` as the module says."""
    bound = max(max_fraction * sample.survivors, MIN_BOUND)
    estimates = tuple(region_estimate(sample, r) for r in configured.regions)
    if fit_radii:
        rule = configured.with_radii(fit_radii_within(estimates, bound))
        return ChanceEstimate(rule, configured, estimates, bound, sample.survivors, allowed=False)
    result = ChanceEstimate(configured, configured, estimates, bound, sample.survivors, allowed=allow)
    if result.expected > bound and not allow:
        worst = max(range(len(estimates)), key=lambda k: estimates[k].expected(configured.regions[k].radius))
        fitted = estimates[worst].fit_radius(_share(estimates, bound))
        change = (
            f"to {fitted}, within its share" if fitted >= 0 else "or remove the region: no radius is within its share"
        )
        raise ChanceBoundError(
            f"dedup: the link rule is expected to link {result.expected:.3g} unrelated pairs by chance at "
            f"N={sample.survivors}, above dedup.max_chance_fraction x N = {bound:.3g}; lower "
            f"dedup.links[{worst}].radius ({change}), or set dedup.fit_radii: true to size the radii from N, or "
            "dedup.allow_chance: true to go on (recorded in the dedup summary and the card)"
        )
    return result
