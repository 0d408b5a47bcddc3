#!/usr/bin/env python3
"""tests/accuracy/drift_law.py's replay, on magnitudes whose law is known: each law must
forecast its own family exactly and miss the other's in the direction the algebra says.
No torch: the replay is plain Python."""

import math
import os
import random
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "accuracy"))
import drift_law  # noqa: E402


def series(law, steps, layers, rng):
    """Per step t (from 0), per layer: the magnitude at step t + 1 under `law`."""
    params = [(rng.uniform(0.5, 2.0), rng.uniform(-0.8, 0.8)) for _ in range(layers)]
    out = []
    for t in range(steps):
        tau = t + 1
        if law == "power":  # m = c tau^k: the controller's law
            out.append([c * tau ** k for c, k in params])
        else:  # m = c exp(k tau / 50): a constant rate
            out.append([c * math.exp(k * tau / 50) for c, k in params])
    return out


class ReplayTest(unittest.TestCase):
    def setUp(self):
        self.rng = random.Random(int(os.environ.get("LGRECO_TEST_SEED", "1")))

    def check(self, law, exact, schedule):
        s = series(law, 200, 5, self.rng)
        misses = drift_law.replay(s, schedule)
        self.assertEqual(len(misses[exact]), len(misses["none"]))
        self.assertGreater(len(misses[exact]), 5)
        # Exact at the epoch's middle; the epoch's mean of a curved law differs from it by
        # the curvature over a period (an exponential of rate a: sinh(aP/2)/(aP/2), 1.7%
        # at the steepest rate here over 20 steps).
        for x, _, _ in misses[exact]:
            self.assertLess(abs(x), 0.03, "%s on a %s series" % (exact, law))
        # Standing still misses every layer that moves, in the direction it moves.
        moved = [abs(x) for x, _, _ in misses["none"]]
        self.assertGreater(max(moved), 0.05)

    def test_power_law_forecasts_a_power_series(self):
        for schedule in drift_law.SCHEDULES.values():
            self.check("power", "power", schedule)

    def test_constant_rate_forecasts_an_exponential_series(self):
        for schedule in drift_law.SCHEDULES.values():
            self.check("rate", "rate", schedule)

    def test_power_law_under_extrapolates_a_constant_rate(self):
        # A power of the step slows as t grows: on a growing exponential it forecasts low,
        # on a falling one high (the demo's fading layers, docs/PERF.md).
        s = series("rate", 200, 8, self.rng)
        misses = drift_law.replay(s, (20, 20, 5, 2))["power"]
        layers = 8
        ks = [(s[1][l] / s[0][l]) for l in range(layers)]  # > 1: growing
        for i, (x, _, _) in enumerate(misses):
            grows = ks[i % layers] > 1
            if abs(math.log(ks[i % layers])) > 0.002:
                self.assertEqual(x < 0, grows, "layer %d: log miss %g" % (i % layers, x))


if __name__ == "__main__":
    unittest.main(verbosity=2)
