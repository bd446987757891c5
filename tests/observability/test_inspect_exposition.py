"""``asyncrl inspect`` reads each process's own gauges from an exposition that holds several roles'
(one registry shared by an embedded controller and the parts run in its interpreter)."""

from asyncrl.observability.inspect_run import summarize_exposition

TEXT = """\
# HELP asyncrl_policy_version Policy version.
# TYPE asyncrl_policy_version gauge
asyncrl_policy_version{component="controller"} 8.0
asyncrl_policy_version{component="buffer"} 2.0
# HELP asyncrl_buffer_groups Groups held.
# TYPE asyncrl_buffer_groups gauge
asyncrl_buffer_groups 5.0
"""


def test_a_process_row_takes_its_own_component_and_the_unlabelled_samples():
    assert summarize_exposition(TEXT, "controller") == {"version": 8.0, "buffer_groups": 5.0}
    assert summarize_exposition(TEXT, "buffer")["version"] == 2.0
    assert summarize_exposition(TEXT)["version"] == 2.0  # no name given: the last sample, as before
