"""Whether engines outlive their agent: decided from what systemd says, on recorded answers."""

from __future__ import annotations

import signal

from llmgw.agent.lifetime import leave_engines, own_scope, restart_job_for, unit_of

# `systemctl list-jobs --no-legend --plain` while `systemctl restart llmgw-agent` runs, and
# while `systemctl stop llmgw-agent` runs
RESTARTING = "1234 llmgw-agent.service restart running\n1240 nginx.service start waiting\n"
STOPPING = "1250 llmgw-agent.service stop running\n"
CGROUP = "0::/system.slice/llmgw-agent.service\n"


def test_the_agents_unit_is_read_from_its_cgroup():
    assert unit_of(CGROUP) == "llmgw-agent.service"
    assert unit_of("12:pids:/user.slice/user-0.slice/session-3.scope\n") is None


def test_a_systemd_restart_leaves_the_engines_and_a_stop_stops_them():
    unit = "llmgw-agent.service"
    assert restart_job_for(unit, RESTARTING) and not restart_job_for(unit, STOPPING)
    assert not restart_job_for(unit, "1234 other.service restart running\n")
    leave, why = leave_engines("keep-on-restart", signal.SIGTERM, unit, RESTARTING)
    assert leave and "restarting llmgw-agent.service" in why
    leave, why = leave_engines("keep-on-restart", signal.SIGTERM, unit, STOPPING)
    assert not leave and "stopping llmgw-agent.service" in why


def test_ctrl_c_no_systemd_and_no_answer_stop_the_engines_unless_configured():
    assert not leave_engines("keep-on-restart", signal.SIGINT, "llmgw-agent.service", RESTARTING)[0]
    assert not leave_engines("keep-on-restart", signal.SIGTERM, None, None)[0]
    assert not leave_engines("keep-on-restart", signal.SIGTERM, "llmgw-agent.service", None)[0]
    assert leave_engines("keep", signal.SIGINT, None, None)[0]
    assert not leave_engines("stop", signal.SIGTERM, "llmgw-agent.service", RESTARTING)[0]


def test_engines_get_a_scope_of_their_own_under_systemd():
    under_systemd = {"INVOCATION_ID": "a1b2"}
    assert own_scope("auto", under_systemd, "/usr/bin/systemd-run")
    assert not own_scope("auto", {}, "/usr/bin/systemd-run")  # a terminal, a test
    assert not own_scope("auto", under_systemd, None)
    assert own_scope("always", {}, None) and not own_scope("never", under_systemd, "/x")
