"""The one installer of upstream adaptations: idempotent per installer, declared order only,
refusal by name before anything is set, and every original back on uninstall."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.eplb import eplb_state  # noqa: E402

from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.upstream.adaptations import ADAPTATIONS, adaptation  # noqa: E402
from eplb_graph.upstream.capability import CapabilityAdaptations  # noqa: E402


def inversion(physical_to_logical_map, num_logical_experts):
    return None


def other_inversion(physical_to_logical_map, num_logical_experts):
    return None


def test_installing_twice_by_the_same_installer_is_a_no_op_and_by_another_an_error():
    upstream, mine = eplb_state.compute_logical_maps, object()
    patches.install("capability.logical_maps", inversion, by=mine)
    try:
        patches.install("capability.logical_maps", inversion, by=mine)
        assert eplb_state.compute_logical_maps is inversion and patches.installed("capability.logical_maps")
        with pytest.raises(patches.AdaptationError, match="already carries capability.logical_maps"):
            patches.install("capability.logical_maps", other_inversion, by=object())
        assert eplb_state.compute_logical_maps is inversion
    finally:
        patches.uninstall("capability.logical_maps")
    assert eplb_state.compute_logical_maps is upstream and not patches.installed("capability.logical_maps")
    assert patches.LEDGER not in vars(eplb_state) or "compute_logical_maps" not in vars(eplb_state)[patches.LEDGER]


def test_a_wrapper_goes_only_over_what_it_declares_and_comes_off_first():
    upstream = eplb_state.compute_logical_maps
    with pytest.raises(patches.AdaptationError, match="carries upstream where probes.logical_maps expects "
                                                      "capability.logical_maps"):
        patches.install("probes.logical_maps", inversion, by="test")
    assert eplb_state.compute_logical_maps is upstream
    patches.install("capability.logical_maps", inversion, by="test")
    patches.install("probes.logical_maps", other_inversion, by="test")
    try:
        assert eplb_state.compute_logical_maps is other_inversion
        with pytest.raises(patches.AdaptationError, match="probes.logical_maps is installed over capability.logical_maps"):
            patches.uninstall("capability.logical_maps")
    finally:
        patches.uninstall("probes.logical_maps")
        assert eplb_state.compute_logical_maps is inversion
        patches.uninstall("capability.logical_maps")
    assert eplb_state.compute_logical_maps is upstream


def test_a_changed_signature_is_refused_by_name_before_anything_is_set(monkeypatch):
    changed = lambda placement: None  # noqa: E731  (upstream's function with one parameter less)
    monkeypatch.setattr(eplb_state, "compute_logical_maps", changed)
    with pytest.raises(patches.AdaptationError, match=r"eplb_state.compute_logical_maps: signature changed \(expected "
                                                      r"parameters \(physical_to_logical_map, num_logical_experts"):
        patches.install("capability.logical_maps", inversion, by="test")
    assert eplb_state.compute_logical_maps is changed
    check = patches.check(adaptation("capability.logical_maps"))
    assert check.status == patches.CHANGED and check.broken


def test_check_names_a_missing_target_and_an_absent_optional_distribution(monkeypatch):
    monkeypatch.delattr(eplb_state, "_commit_eplb_maps")
    assert patches.check(adaptation("capability.commit_all")).status == patches.MISSING
    assert patches.check(adaptation("capability.commit_layer")).status == patches.OK
    ascend = patches.check(adaptation("runner.ascend_v1_load_model"))
    assert ascend.status == patches.NOT_HERE and not ascend.broken  # vllm-ascend is not installed here


def test_a_global_is_set_for_its_scope_and_restored():
    upstream = parallel_state._NODE_COUNT
    patches.install("elastic.node_count", 7, by="session")
    assert parallel_state._NODE_COUNT == 7
    patches.uninstall("elastic.node_count")
    assert parallel_state._NODE_COUNT is upstream


def test_a_hook_shadows_the_class_on_one_instance_and_is_deleted_again():
    class Router:
        def _apply_eplb_mapping(self, topk_ids):
            return topk_ids

    bound, other = Router(), Router()
    with pytest.raises(patches.AdaptationError, match="is a hook: it goes on an instance"):
        patches.install("router.apply_eplb_mapping", lambda topk_ids: None, by="layer")
    patches.install("router.apply_eplb_mapping", lambda topk_ids: "ours", by="layer", on=bound)
    assert bound._apply_eplb_mapping(1) == "ours" and other._apply_eplb_mapping(1) == 1
    patches.uninstall("router.apply_eplb_mapping", on=bound)
    assert "_apply_eplb_mapping" not in vars(bound) and bound._apply_eplb_mapping(1) == 1

    class NoHook:
        pass

    with pytest.raises(patches.AdaptationError, match="BaseRouter._apply_eplb_mapping: target missing"):
        patches.install("router.apply_eplb_mapping", lambda topk_ids: None, by="layer", on=NoHook())


def test_an_inherited_attribute_is_deleted_again_not_copied_down():
    """A class that inherits the target (vllm-ascend's V2 runner inherits load_model): ours goes
    on the subclass, its base keeps upstream's, and taking it back deletes it."""
    import sys
    import types

    from eplb_graph.upstream.adaptations import adaptation as declared

    entry = declared("runner.ascend_v2_load_model")
    module = types.ModuleType(entry.module)

    class Base:
        def load_model(self):
            return "upstream"

    module.NPUModelRunner = type("NPUModelRunner", (Base,), {})
    sys.modules[entry.module] = module
    try:
        ours = lambda self: "ours"  # noqa: E731
        patches.install(entry.key, ours, by="test")
        assert module.NPUModelRunner().load_model() == "ours" and Base().load_model() == "upstream"
        assert patches.check(entry).status == patches.OK or patches.check(entry).status == patches.NOT_HERE
        patches.uninstall(entry.key)
        assert "load_model" not in vars(module.NPUModelRunner) and module.NPUModelRunner().load_model() == "upstream"
    finally:
        del sys.modules[entry.module]


def test_a_scoped_field_is_set_for_the_body_and_given_back_also_when_it_raises():
    import dataclasses

    @dataclasses.dataclass
    class Args:  # the fields of EngineArgs the gate turns off around upstream's call
        enable_eplb: bool = True
        eplb_config: object = None

    requested = object()
    args = Args(eplb_config=requested)
    with patches.scoped("gate.args_enable_eplb", False, on=args, by="test"), \
            patches.scoped("gate.args_eplb_config", "default", on=args, by="test"):
        assert (args.enable_eplb, args.eplb_config) == (False, "default")
    assert args.enable_eplb is True and args.eplb_config is requested and patches.LEDGER not in vars(args)
    with pytest.raises(ValueError, match="refused"):
        with patches.scoped("gate.args_enable_eplb", False, on=args, by="test"):
            raise ValueError("refused")
    assert args.enable_eplb is True and patches.LEDGER not in vars(args)
    with pytest.raises(patches.AdaptationError, match="gate.args_enable_eplb is a scoped: scoped"):
        patches.install("gate.args_enable_eplb", False, by="test", on=args)
    with pytest.raises(patches.AdaptationError, match=r"EngineArgs.enable_eplb: target missing"):
        with patches.scoped("gate.args_enable_eplb", False, on=object(), by="test"):
            pass


def test_an_attribute_of_ours_goes_on_one_instance_and_one_of_upstream_is_a_clash():
    class Runner:
        def load_model(self):
            self.model = "loaded"

    runner, other = Runner(), Runner()
    worker = object()
    patches.install("worker.on_runner", worker, by="test", on=runner)
    assert runner.eplb_graph is worker and not hasattr(other, "eplb_graph")
    patches.uninstall("worker.on_runner", on=runner)
    assert not hasattr(runner, "eplb_graph") and patches.LEDGER not in vars(runner)

    class Grown(Runner):  # upstream names an attribute of its own so
        def load_model(self):
            self.eplb_graph = "upstream's"

    with pytest.raises(patches.AdaptationError, match="GPUModelRunner.eplb_graph: signature changed "
                                                      r"\(Grown has an attribute eplb_graph of its own\)"):
        patches.install("worker.on_runner", worker, by="test", on=Grown())


def test_an_insert_goes_first_in_its_list_and_comes_out_again(monkeypatch):
    import sys

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # this test's own list, and ledger
    monkeypatch.delattr(sys, patches.LEDGER, raising=False)
    before = list(sys.meta_path)
    finder = object()
    patches.install("imports.after_import", finder, by="test")
    patches.install("imports.after_import", finder, by="test")  # once
    assert sys.meta_path == [finder, *before] and "imports.after_import" in patches.installed_keys()
    assert patches.check(adaptation("imports.after_import")).status == patches.OK
    patches.uninstall("imports.after_import")
    assert sys.meta_path == before and not patches.installed("imports.after_import")


def test_configure_checks_the_field_and_refuses_other_kinds():
    from vllm.config import ParallelConfig

    class NotAConfig:
        pass

    with pytest.raises(patches.AdaptationError, match=r"ParallelConfig.enable_eplb: target missing \(NotAConfig has "
                                                      r"no field enable_eplb\)"):
        patches.configure("config.cpu_enable_eplb", True, on=NotAConfig())
    config = ParallelConfig()
    patches.configure("config.cpu_enable_eplb", True, on=config)
    assert config.enable_eplb is True
    with pytest.raises(patches.AdaptationError, match="capability.logical_maps is a replace, not a configuration"):
        patches.configure("capability.logical_maps", inversion, on=config)
    with pytest.raises(patches.AdaptationError, match="config.cpu_enable_eplb is a config: configure"):
        patches.install("config.cpu_enable_eplb", True, by="test")


def test_a_module_that_fails_to_import_is_reported_not_raised(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.cpu_communicator", None)  # import fails
    check = patches.check(adaptation("dp_dispatch.all_gatherv"))
    assert check.status == patches.IMPORT_FAILED and check.broken and "ModuleNotFoundError" in check.detail


def test_the_same_installer_with_another_replacement_is_an_error():
    patches.install("capability.logical_maps", inversion, by="test")
    try:
        with pytest.raises(patches.AdaptationError, match="with another replacement"):
            patches.install("capability.logical_maps", other_inversion, by="test")
    finally:
        patches.uninstall("capability.logical_maps")


def test_uninstall_all_restores_every_original():
    names = {(a.module, a.qualname) for a in ADAPTATIONS if a.module.startswith("vllm.distributed")
             and a.how in ("replace", "wrap", "global")}
    import functools
    import importlib

    def target(module: str, qualname: str):  # a class's attribute too (StatelessGroupCoordinator.__init__)
        return functools.reduce(getattr, qualname.split("."), importlib.import_module(module))

    before = {key: target(*key) for key in names}
    before_keys = set(patches.installed_keys())
    adapter = CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None, placement_check=lambda *a: None)
    adapter.install()
    patches.install("probes.logical_maps", inversion, by="test")
    patches.install("elastic.ep_group", object(), by="test")
    added = set(patches.installed_keys()) - before_keys
    assert {"capability.state_event", "probes.logical_maps", "elastic.ep_group"} <= added
    taken_back = patches.uninstall_all(added)  # not the plugin's own, which other tests rely on
    assert "probes.logical_maps" in taken_back and "capability.logical_maps" in taken_back
    after = {key: target(*key) for key in names}
    assert all(after[key] is before[key] for key in before)
    assert set(patches.installed_keys()) == before_keys
