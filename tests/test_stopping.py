from ember.offload.decode.stopping import StopStrings


def _run(stops, deltas):
    s = StopStrings(stops)
    shown = "".join(s.push(d) for d in deltas)
    return shown + s.flush(), s.stopped


def test_stop_string_split_across_deltas_is_cut():
    assert _run(["END"], ["abc E", "N", "D more"]) == ("abc ", True)


def test_partial_prefix_is_released_when_it_does_not_complete():
    assert _run(["END"], ["abc E", "N", "x"]) == ("abc ENx", False)


def test_held_text_is_flushed_at_the_end():
    assert _run(["\n\n"], ["line\n"]) == ("line\n", False)


def test_earliest_of_several_stops_wins():
    assert _run(["b", "xy"], ["axyb"]) == ("a", True)


def test_no_stops_passes_everything():
    assert _run([], ["a", "b"]) == ("ab", False)


def test_leading_spaces_are_dropped_when_asked():
    s = StopStrings(["\nUser:"], strip_leading=True)
    shown = "".join(s.push(d) for d in [" ", " Paris", " is", "\nUser:"])
    assert (shown + s.flush(), s.stopped) == ("Paris is", True)


def test_a_stop_string_at_the_very_start_ends_with_an_empty_reply():
    s = StopStrings(["\n\n"], strip_leading=True)
    assert s.push(" \n") == "" and s.push("\nmore") == "" and s.stopped


def test_leading_spaces_stay_by_default():
    assert _run(["END"], [" a"]) == (" a", False)
