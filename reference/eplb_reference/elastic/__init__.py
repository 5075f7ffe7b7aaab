"""Elastic expert parallelism for the reference runtime: the EP group resized, and recovered, while it serves.

    protocol.py        every store key and value the coordinator and the members meet under (``Board``)
    spec.py            what the members of one run share (``ElasticSpec``) and report (``MemberResult``)
    member.py          a member's decisions, pure functions of what it read (the state machine)
    member_process.py  a member process doing what they decide; serving.py: serving requests
    group.py           its gloo groups, one generation at a time, the next built beside (the EP ops' slot)
    stack.py, reshuffle.py, eplb.py, recovery.py
                       its share of the model, the weight move of a resize, upstream's EPLB between
                       resizes, surviving a dead member
    liveness.py        keep-alive and the failure detector (hangs as well as deaths)
    processes.py       member processes, started here or offered from outside (``join.py``)
    coordinator.py     the one loop both drivers run: scripted.py (``run --scale-plan``) and
                       server.py (``serve``, with http.py and completions.py); chaos.py, report.py, cli.py
"""
