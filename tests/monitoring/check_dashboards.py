"""Checks kvcm's Grafana dashboards and provisioning files without a Grafana.

Each dashboard (monitoring/grafana/dashboards/*.json) is decoded with the types of
grafana-foundation-sdk, which Grafana generates from its own dashboard schema
(tests/monitoring/requirements.txt pins the Grafana 11.6 line):

- decoding: Dashboard.from_json with every panel and query type registered;
- types: every decoded field against the SDK's type hints (str, int, float, bool, enums and
  literals by value, lists, nested schema objects), panels' options and field config through
  their panel plugin's types, queries through the Prometheus query type;
- nothing unknown: encoding the decoded dashboard again must give back every key and value
  of the file (the SDK drops what its schema does not have, so a misspelt or invented key
  is caught);

and then against kvcm's own rules: a unique uid (Grafana's limit: 40 characters), a
`datasource` variable of type datasource for Prometheus whose default is the provisioned
datasource's uid, every panel and query on `${datasource}`, every non-row panel with a title,
a description and a unit Grafana knows (the SDK's unit list, or a custom "suffix:"/"prefix:"
unit), every query with a PromQL expression, unique panel ids and refIds.

To show that it can fail, it also breaks a copy of the first dashboard in each of the ways
in BREAKAGES, one at a time, and fails if it does not find one of them.

The provisioning files (monitoring/grafana/provisioning/) must give the datasource a fixed
uid and type prometheus, and a file dashboard provider with a path.

  check_dashboards.py MONITORING_DIR        # exit 0, or the problems and exit 1
"""

import enum
import inspect
import json
import pathlib
import sys
import types
import typing

import yaml
from grafana_foundation_sdk.cog import encoder as cogencoder
from grafana_foundation_sdk.cog import plugins as cogplugins
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import dashboard as sdkdashboard
from grafana_foundation_sdk.models import units as sdkunits

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
CUSTOM_UNIT_PREFIXES = ("suffix:", "prefix:")
SDK_PACKAGE = "grafana_foundation_sdk"


def known_units() -> set[str]:
    return {value for name, value in vars(sdkunits).items()
            if not name.startswith("_") and isinstance(value, str)}


def is_sdk_class(cls: object) -> bool:
    return inspect.isclass(cls) and cls.__module__.startswith(SDK_PACKAGE)


def matches_shape(value: object, hint: object) -> bool:
    """Whether `value` is a list, an object or a schema class instance as `hint` is."""
    if hint is object or hint is typing.Any:
        return is_sdk_class(type(value))  # a panel plugin's options or field config
    origin = typing.get_origin(hint)
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if inspect.isclass(hint) and is_sdk_class(hint) and not issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    return False


def check_type(value: object, hint: object, where: str, problems: list[str]) -> None:
    """Appends to `problems` where `value` is not of the SDK's type `hint`."""
    if hint is typing.Any or hint is object:
        if is_sdk_class(type(value)):
            check_object(value, where, problems)
        return
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        # The option of the value's shape (a list, an object, a schema class), when there is
        # one, is checked for itself so that its problems are reported where they are.
        shaped = [option for option in args if matches_shape(value, option)]
        if len(shaped) == 1:
            check_type(value, shaped[0], where, problems)
            return
        for option in args:
            trial: list[str] = []
            check_type(value, option, where, trial)
            if not trial:
                return
        problems.append(f"{where}: {value!r} is none of {hint}")
        return
    if hint is type(None):
        if value is not None:
            problems.append(f"{where}: {value!r} is not null")
        return
    if origin is typing.Literal:
        if value not in args:
            problems.append(f"{where}: {value!r} is not one of {list(args)}")
        return
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: {value!r} is not a list")
            return
        for i, item in enumerate(value):
            check_type(item, args[0] if args else typing.Any, f"{where}[{i}]", problems)
        return
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: {value!r} is not an object")
            return
        for key, item in value.items():
            check_type(item, args[1] if args else typing.Any, f"{where}.{key}", problems)
        return
    if inspect.isclass(hint) and issubclass(hint, enum.Enum):
        allowed = [member.value for member in hint]
        if (value.value if isinstance(value, enum.Enum) else value) not in allowed:
            problems.append(f"{where}: {value!r} is not one of {allowed}")
        return
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: {value!r} is not a boolean")
        return
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: {value!r} is not an integer")
        return
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: {value!r} is not a number")
        return
    if hint is str:
        if not isinstance(value, str):
            problems.append(f"{where}: {value!r} is not a string")
        return
    if hint is cogvariants.Dataquery:
        if isinstance(value, cogruntime.UnknownDataquery):
            problems.append(f"{where}: a query of no data source type the SDK knows")
        elif not isinstance(value, cogvariants.Dataquery):
            problems.append(f"{where}: {value!r} is not a query")
        else:
            check_object(value, where, problems)
        return
    if inspect.isclass(hint):
        if not isinstance(value, hint):
            problems.append(f"{where}: {value!r} is not a {hint.__name__}")
        elif is_sdk_class(hint):
            check_object(value, where, problems)
        return
    problems.append(f"{where}: cannot check type {hint}")


def check_object(obj: object, where: str, problems: list[str]) -> None:
    """Checks every annotated field of an SDK object against its type hint."""
    hints = typing.get_type_hints(type(obj))
    for name, hint in hints.items():
        if name.startswith("_") or not hasattr(obj, name):
            continue
        check_type(getattr(obj, name), hint, f"{where}.{name}", problems)


def missing_after_round_trip(original: object, encoded: object, where: str,
                             problems: list[str]) -> None:
    """Appends what of `original` did not survive decoding and encoding again."""
    if isinstance(original, dict):
        if not isinstance(encoded, dict):
            problems.append(f"{where}: became {encoded!r}")
            return
        for key, value in original.items():
            if key not in encoded:
                problems.append(f"{where}.{key}: not in Grafana's schema (dropped by the SDK)")
            else:
                missing_after_round_trip(value, encoded[key], f"{where}.{key}", problems)
    elif isinstance(original, list):
        if not isinstance(encoded, list) or len(encoded) != len(original):
            problems.append(f"{where}: list changed to {encoded!r}")
            return
        for i, (a, b) in enumerate(zip(original, encoded)):
            missing_after_round_trip(a, b, f"{where}[{i}]", problems)
    elif original != encoded or type(original) is bool and type(encoded) is not bool:
        problems.append(f"{where}: {original!r} came back as {encoded!r}")


def all_panels(panels: list[dict]) -> typing.Iterator[dict]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def check_kvcm_rules(name: str, data: dict, datasource_uid: str, units: set[str],
                     problems: list[str]) -> None:
    uid = data.get("uid", "")
    if not uid or len(uid) > 40:
        problems.append(f"{name}: uid {uid!r} must be 1 to 40 characters")
    variables = [v for v in data.get("templating", {}).get("list", [])
                 if v.get("name") == "datasource"]
    if len(variables) != 1 or variables[0].get("type") != "datasource" or \
            variables[0].get("query") != "prometheus":
        problems.append(f"{name}: needs one variable `datasource` of type datasource for "
                        "prometheus")
    elif variables[0].get("current", {}).get("value") != datasource_uid:
        problems.append(f"{name}: the datasource variable's default is not the provisioned "
                        f"uid {datasource_uid!r}")
    ids = set()
    for panel in all_panels(data.get("panels", [])):
        where = f"{name}: panel {panel.get('id')} {panel.get('title')!r}"
        if panel.get("id") in ids:
            problems.append(f"{where}: id used twice")
        ids.add(panel.get("id"))
        if not panel.get("title"):
            problems.append(f"{where}: no title")
        if panel.get("type") == "row":
            continue
        if cogruntime.panelcfg_config(panel.get("type", "")) is None:
            problems.append(f"{where}: panel type {panel.get('type')!r} is not Grafana's")
        if not panel.get("description"):
            problems.append(f"{where}: no description")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if not unit:
            problems.append(f"{where}: no unit")
        elif unit not in units and not unit.startswith(CUSTOM_UNIT_PREFIXES):
            problems.append(f"{where}: unit {unit!r} is not a Grafana unit")
        if panel.get("datasource") != DATASOURCE_REF:
            problems.append(f"{where}: datasource is not {DATASOURCE_REF}")
        targets = panel.get("targets", [])
        if not targets:
            problems.append(f"{where}: no query")
        ref_ids = [t.get("refId") for t in targets]
        if len(set(ref_ids)) != len(ref_ids):
            problems.append(f"{where}: refIds {ref_ids} repeat")
        for target in targets:
            if target.get("datasource", DATASOURCE_REF) != DATASOURCE_REF:
                problems.append(f"{where}: query {target.get('refId')} not on ${{datasource}}")
            if not target.get("expr", "").strip():
                problems.append(f"{where}: query {target.get('refId')} has no expr")


def check_dashboard(name: str, data: dict, datasource_uid: str, units: set[str],
                    problems: list[str]) -> None:
    """Checks one dashboard's JSON."""
    try:
        decoded = sdkdashboard.Dashboard.from_json(data)
    except Exception as error:  # the SDK raises whatever a wrong shape gives it
        problems.append(f"{name}: Grafana's dashboard types refuse it: {error!r}")
        return
    check_object(decoded, name, problems)
    encoded = json.loads(json.dumps(decoded, cls=cogencoder.JSONEncoder))
    missing_after_round_trip(data, encoded, name, problems)
    check_kvcm_rules(name, data, datasource_uid, units, problems)


# Breakages the checker must find, each applied alone to a copy of a good dashboard: if one
# passes, the checker itself is broken. (path in the dashboard, key, bad value)
BREAKAGES = [
    ((), "graphTooltip", 7),                                   # not a DashboardCursorSync
    (("panels", 1), "titel", "x"),                             # not in the schema
    (("panels", 1), "title", 5),                               # not a string
    (("panels", 1), "type", "graph2"),                         # no such panel
    (("panels", 1), "description", ""),                        # kvcm: no description
    (("panels", 1, "fieldConfig", "defaults"), "unit", "blocks"),  # no such unit
    (("panels", 1, "targets", 0), "exprr", "up"),              # not in the query schema
    (("panels", 1, "targets", 0), "instant", "yes"),           # not a boolean
    (("panels", 1), "datasource", {"type": "prometheus", "uid": "other"}),
]


def self_test(data: dict, datasource_uid: str, units: set[str]) -> list[str]:
    """The breakages the checker missed."""
    missed = []
    for path, key, value in BREAKAGES:
        broken = json.loads(json.dumps(data))
        node = broken
        for step in path:
            node = node[step]
        node[key] = value
        found: list[str] = []
        check_dashboard("self-test", broken, datasource_uid, units, found)
        if not found:
            missed.append(f"self-test: {'.'.join(map(str, path + (key,)))} = {value!r} "
                          "was not found")
    return missed


def check_provisioning(provisioning: pathlib.Path, problems: list[str]) -> str:
    """Checks the provisioning files; returns the datasource's uid."""
    uid = ""
    datasources = sorted((provisioning / "datasources").glob("*.yml"))
    if not datasources:
        problems.append(f"{provisioning}/datasources: no datasource file")
    for path in datasources:
        config = yaml.safe_load(path.read_text())
        for ds in config.get("datasources", []):
            if ds.get("type") != "prometheus" or not ds.get("uid") or not ds.get("url"):
                problems.append(f"{path.name}: datasource {ds.get('name')!r} needs type "
                                "prometheus, a fixed uid and a url")
            else:
                uid = ds["uid"]
    providers = sorted((provisioning / "dashboards").glob("*.yml"))
    if not providers:
        problems.append(f"{provisioning}/dashboards: no dashboard provider file")
    for path in providers:
        config = yaml.safe_load(path.read_text())
        for provider in config.get("providers", []):
            if provider.get("type") != "file" or not provider.get("options", {}).get("path"):
                problems.append(f"{path.name}: provider {provider.get('name')!r} needs type "
                                "file and options.path")
    return uid


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    root = pathlib.Path(sys.argv[1])
    cogplugins.register_default_plugins()
    problems: list[str] = []
    datasource_uid = check_provisioning(root / "grafana" / "provisioning", problems)
    units = known_units()
    dashboards = sorted((root / "grafana" / "dashboards").glob("*.json"))
    if not dashboards:
        problems.append(f"{root}/grafana/dashboards: no dashboard")
    uids: dict[str, str] = {}
    panels = 0
    for path in dashboards:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            problems.append(f"{path.name}: {error}")
            continue
        check_dashboard(path.name, data, datasource_uid, units, problems)
        uid = data.get("uid", "")
        if uid in uids:
            problems.append(f"{path.name}: uid {uid!r} is also {uids[uid]}'s")
        uids[uid] = path.name
        panels += sum(1 for _ in all_panels(data.get("panels", [])))
        if len(uids) == 1:
            problems.extend(self_test(data, datasource_uid, units))
    for problem in problems:
        print(problem)
    print(f"{len(dashboards)} dashboards, {panels} panels: {len(problems)} problems "
          f"(and each of the {len(BREAKAGES)} deliberate breakages of the first one found)"
          if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
