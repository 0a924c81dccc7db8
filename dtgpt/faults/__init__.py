"""Fault tolerance: what a run does when it is stopped, killed, stuck or made to fail (docs/faults.md).

One concern per module; import the one you need (this package imports none of them, so
`import dtgpt.faults.watchdog` stays as light as the module itself):

- `signals`: the save on a signal. SIGTERM/SIGINT, `exit_duration_in_mins` and `exit_interval`
  stop every rank after the same iteration, which is then saved (`ExitConditions`).
- `last_words`: the survivors' save after a hard failure (a peer SIGKILLed, segfaulted, OOM
  killed): roll call, decide, save the last completed iteration over the survivors' group.
- `detect`: failure detection: the first rank whose collective fails posts a notice in the
  attempt's store, and every rank leaves its collectives within a second (no collective timeout).
- `recovery`: in-process recovery under `python -m dtgpt.run`: the survivors keep their state,
  rebuild the process groups, and the replacement of a dead rank takes its state from its
  replica twin (`handover`); the interrupted iteration is redone, nothing is read from disk.
- `attempt_store`: the store prefix of one torchrun attempt, so a restarted group never reads a
  dead attempt's keys.
- `watchdog`: the heartbeat line when an iteration runs far longer than usual.
- `injection`: deliberate faults (`[faults]`) for the tests and `scripts/fault_drill.py`: one
  hook object (`FaultHooks`; `NO_FAULTS` does nothing).
"""
