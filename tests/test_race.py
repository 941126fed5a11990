"""The race behind both searches (`dtrain.collectives.auto.race`): the paired dropping rule and the pick."""

from dtrain.collectives.auto import race


def _three():
    lead, close, slow = race.Entrant("lead"), race.Entrant("close"), race.Entrant("slow")
    drift = [500, 620, 540, 700, 520, 610]  # the machine's speed moves all three alike
    lead.times = dict(enumerate(drift))
    close.times = {r: t + (4 if r % 2 else -3) for r, t in enumerate(drift)}  # as fast, within noise
    slow.times = {r: t + 25 + r for r, t in enumerate(drift)}  # always slower, by less than the drift
    return lead, close, slow


def test_a_candidate_is_dropped_only_when_the_paired_interval_excludes_zero():
    lead, close, slow = _three()
    assert race.drop([lead, close, slow], min_rounds=6, loss_tolerance=0.01) == [lead, close]
    assert slow.status == "dropped: measured" and slow.diff[1] > 0 and "slower than the leader" in slow.reason
    # fewer rounds than min_rounds: nobody is dropped yet
    lead, close, slow = _three()
    assert race.drop([lead, close, slow], min_rounds=7, loss_tolerance=0.01) == [lead, close, slow]


def test_a_lossy_candidate_goes_when_its_loss_is_above_the_tolerance():
    lead, close, _ = _three()
    close.lossless = False
    lead.losses = {r: 2.0 for r in lead.times}
    close.losses = {r: 2.1 for r in close.times}  # 5% above
    assert race.drop([lead, close], min_rounds=6, loss_tolerance=0.10) == [lead, close]
    assert race.drop([lead, close], min_rounds=6, loss_tolerance=0.01) == [lead]
    assert "lossy and its loss +5.0%" in close.reason


def test_the_pick_is_the_fastest_median_and_the_rest_say_why_they_were_kept():
    lead, close, slow = _three()
    winner = race.pick([slow, close, lead], budget_steps=30)
    assert winner is lead and lead.status == "winner"
    assert close.status == slow.status == "kept: budget" and "within the budget of 30 steps" in close.reason
    assert close.diff is not None and abs(close.diff[0]) < 5
    unmeasured = [race.Entrant("a"), race.Entrant("b")]
    assert race.pick(unmeasured, 10) is unmeasured[0]  # nothing measured: the first, in the order given


def test_the_pick_takes_the_rounds_as_blocks():
    # the rounds ran at different machine speeds; b's one fast step, in round 1, gives it the lowest plain median,
    # while a is the fastest in the other two rounds, and so the fastest against each round's median
    a = race.Entrant("a", times={0: 100.0, 1: 200.0, 2: 300.0})
    b = race.Entrant("b", times={0: 102.0, 1: 150.0, 2: 302.0})
    c = race.Entrant("c", times={0: 104.0, 1: 204.0, 2: 304.0})
    assert min((a, b, c), key=lambda e: e.measured_ms) is b
    assert race.blocked_ms([a, b, c]) == {"a": -2.0, "b": 0.0, "c": 2.0}
    assert race.pick([a, b, c], 30) is a and b.status == "kept: budget" and b.diff[0] == 2.0
    # with no round in common, each one's own median
    d = race.Entrant("d", times={5: 90.0})
    assert race.blocked_ms([a, d]) == {"a": 200.0, "d": 90.0} and race.leader([a, d]) is d
