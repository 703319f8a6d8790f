"""Declaring RPC messages: typed, validated, one class per request and per reply.

A message class lists its fields with a *field spec* (``Int``, ``Bytes``, ``List``...):
the wire key, the Python type, the limits and the errno a violation answers::

    class Getattr(MetaRequest, method="getattr", reply=AttrReply):
        ino: int = Int()

The metaclass turns the specs into ``__slots__`` and compiles, per class, a
``from_wire(map, payload)`` that validates and builds the object, and a ``to_wire()``
that gives the map (requests carry their method name under ``"m"``). The compiled code
is straight-line: a dict lookup and a type test per field, the full check (conversion,
default, the error naming the field) only when the quick test fails, so decoding costs
no more than the ad-hoc checks it replaces.

The wire format is the msgpack map of ``docs/rpc.md``; a field whose value is ``None``
is left out of the map (the decoder reads an absent and a nil field alike) unless it
is declared ``nil=True`` (fields the protocol has always sent as nil).
"""
from __future__ import annotations

import errno
from typing import Any, ClassVar, TypeVar, dataclass_transform

_M = TypeVar("_M", bound="Message")
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


def violation(code: int, text: str) -> OSError:
    """The error a request that breaks a field's rule answers."""
    return OSError(code, text)


# ---------------------------------------------------------------------------
# field specs
# ---------------------------------------------------------------------------
class Field:
    """One field: its wire key, documentation, default and how it is checked.

    ``quick(v)`` is a Python expression over the local ``v`` that holds when the wire
    value is already valid as-is (the common case, inlined in ``from_wire``);
    ``convert(v, method)`` is the full check: default for an absent or nil value,
    conversion, or the ``OSError`` naming the field."""

    type_doc = "any"

    def __init__(self, *, default: Any = REQUIRED, doc: str = "", key: str = "",
                 code: int = errno.EINVAL, nil: bool = False, sparse: bool = False) -> None:
        self.default = default
        self.nil = nil  # sent even when None (else a None field is left out)
        self.sparse = sparse  # not sent when it is its default either
        self.doc = doc
        self.key = key  # filled from the attribute name when empty
        self.name = ""  # attribute name
        self.code = code  # errno of a type violation

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def quick(self, v: str) -> str:
        return "False"

    def build(self, v: str) -> str:
        """Expression: the value the handler gets from a ``v`` that passed ``quick``."""
        return v

    def check(self, v: Any, method: str) -> Any:
        """The value as the handler gets it; raises on a violation."""
        return v

    def convert(self, v: Any, method: str) -> Any:
        if v is MISSING or v is None:
            if self.default is REQUIRED:
                raise violation(errno.EINVAL, f"{method}: missing field '{self.key}'")
            return self.default
        return self.check(v, method)

    def encode(self, v: Any) -> Any:
        return v

    def fail(self, method: str, what: str, code: int | None = None) -> OSError:
        return violation(self.code if code is None else code,
                    f"{method}: field '{self.key}' must be {what}")

    def limits(self) -> str:
        """The limits in words, for docs/rpc.md ("" when none)."""
        return ""

    def describe(self) -> str:
        what = self.doc or ", ".join(x for x in (self.type_doc, self.limits()) if x)
        return f"`{self.key}` ({what})"


def _len_limit(max_len: int | None, code: int, unit: str) -> str:
    if max_len is None:
        return ""
    text = f"at most {max_len} {unit}"
    return text if code == errno.EINVAL else f"{text}, else {errno.errorcode[code]}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class IntField(Field):
    type_doc = "int"

    def __init__(self, *, lo: int | None = None, hi: int | None = None,
                 range_code: int = errno.EINVAL, **kw: Any) -> None:
        super().__init__(**kw)
        self.lo, self.hi, self.range_code = lo, hi, range_code

    def limits(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"{self.lo} to {self.hi}"
        if self.lo is not None:
            return f">= {self.lo}"
        return "" if self.hi is None else f"<= {self.hi}"

    def quick(self, v: str) -> str:
        expr = f"type({v}) is int"
        if self.lo is not None:
            expr += f" and {v} >= {self.lo}"
        if self.hi is not None:
            expr += f" and {v} <= {self.hi}"
        return expr

    def check(self, v: Any, method: str) -> Any:
        if not _is_int(v):
            raise self.fail(method, "an integer")
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise violation(self.range_code, f"{method}: {self.key} {v} out of range "
                                        f"[{self.lo}, {self.hi}]")
        return int(v)


class BoolField(Field):
    type_doc = "bool"

    def quick(self, v: str) -> str:
        return f"{v} is True or {v} is False"

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, bool):
            raise self.fail(method, "a boolean")
        return v


class StrField(Field):
    type_doc = "str"

    def __init__(self, *, max_len: int | None = None, len_code: int = errno.EINVAL,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.max_len, self.len_code = max_len, len_code

    def limits(self) -> str:
        return _len_limit(self.max_len, self.len_code, "characters")

    def quick(self, v: str) -> str:
        expr = f"type({v}) is str"
        return expr if self.max_len is None else f"{expr} and len({v}) <= {self.max_len}"

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, str):
            raise self.fail(method, "a string")
        if self.max_len is not None and len(v) > self.max_len:
            raise violation(self.len_code, f"{method}: field '{self.key}' longer than "
                                      f"{self.max_len}")
        return str(v)


class BytesField(Field):
    """Bytes; a str is taken as its ``surrogateescape`` encoding (names from clients
    that send text)."""

    type_doc = "bytes"

    def __init__(self, *, max_len: int | None = None, len_code: int = errno.EINVAL,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.max_len, self.len_code = max_len, len_code

    def limits(self) -> str:
        return _len_limit(self.max_len, self.len_code, "bytes")

    def quick(self, v: str) -> str:
        expr = f"type({v}) is bytes"
        return expr if self.max_len is None else f"{expr} and len({v}) <= {self.max_len}"

    def check(self, v: Any, method: str) -> Any:
        if isinstance(v, str):
            v = v.encode("utf-8", "surrogateescape")
        elif not isinstance(v, (bytes, bytearray, memoryview)):
            raise self.fail(method, "bytes")
        if self.max_len is not None and len(v) > self.max_len:
            raise violation(self.len_code, f"{method}: field '{self.key}' of {len(v)} bytes, "
                                      f"at most {self.max_len}")
        return bytes(v)


class ListField(Field):
    """A list whose length is checked before its items are (and before anything is
    built from them); ``item`` checks each one."""

    type_doc = "list"

    def __init__(self, item: Field | None = None, *, max_len: int | None = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.item, self.max_len = item, max_len

    def limits(self) -> str:
        return "" if self.max_len is None else f"at most {self.max_len} items"

    def quick(self, v: str) -> str:
        expr = f"type({v}) is list"
        if self.max_len is not None:
            expr += f" and len({v}) <= {self.max_len}"
        if self.item is not None:
            if self.item.build("x") != "x":
                return "False"  # its items are converted: always the full check
            expr += f" and all({self.item.quick('x')} for x in {v})"
        return expr

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, (list, tuple)):
            raise self.fail(method, "a list")
        if self.max_len is not None and len(v) > self.max_len:
            raise violation(errno.EINVAL, f"{method}: {self.key}: {len(v)} items, "
                                     f"at most {self.max_len}")
        if self.item is None:
            return list(v)
        item = self.item
        if not item.key:
            item.key = f"{self.key}[]"
        return [item.check(x, method) for x in v]


class MapField(Field):
    """A map (a shared record such as ``attr``): checked to be a map; its keys are the
    record's, documented in ``docs/rpc.md``."""

    type_doc = "map"

    def __init__(self, record: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.record = record

    def quick(self, v: str) -> str:
        return f"type({v}) is dict"

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, dict):
            raise self.fail(method, f"a map{f' ({self.record})' if self.record else ''}")
        return v


class AnyField(Field):
    def quick(self, v: str) -> str:
        return "True"


class PayloadField(Field):
    """The frame's raw payload (bulk bytes), not a key of the map."""

    type_doc = "payload"

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("default", None)
        super().__init__(**kw)


# ---------------------------------------------------------------------------
# field specifiers (typed Any so a declaration reads ``ino: int = Int()``)
# ---------------------------------------------------------------------------
def Int(*, default: Any = REQUIRED, lo: int | None = None, hi: int | None = None,  # noqa: N802
        doc: str = "", key: str = "", range_code: int = errno.EINVAL, nil: bool = False) -> Any:
    return IntField(default=default, lo=lo, hi=hi, doc=doc, key=key, range_code=range_code,
                    nil=nil)


def Bool(*, default: Any = REQUIRED, doc: str = "", key: str = "",  # noqa: N802
         sparse: bool = False) -> Any:
    return BoolField(default=default, doc=doc, key=key, sparse=sparse)


def Str(*, default: Any = REQUIRED, max_len: int | None = None, doc: str = "",  # noqa: N802
        key: str = "", nil: bool = False) -> Any:
    return StrField(default=default, max_len=max_len, doc=doc, key=key, nil=nil)


def Bytes(*, default: Any = REQUIRED, max_len: int | None = None,  # noqa: N802
          len_code: int = errno.EINVAL, doc: str = "", key: str = "") -> Any:
    return BytesField(default=default, max_len=max_len, len_code=len_code, doc=doc, key=key)


def List(item: Field | None = None, *, default: Any = REQUIRED,  # noqa: N802
         max_len: int | None = None, doc: str = "", key: str = "") -> Any:
    return ListField(item, default=default, max_len=max_len, doc=doc, key=key)


def Map(record: str = "", *, default: Any = REQUIRED, doc: str = "",  # noqa: N802
        key: str = "", nil: bool = False) -> Any:
    return MapField(record, default=default, doc=doc, key=key, nil=nil)


def Anything(*, default: Any = REQUIRED, doc: str = "", key: str = "") -> Any:  # noqa: N802
    return AnyField(default=default, doc=doc, key=key)


def Payload(*, default: Any = None, doc: str = "") -> Any:  # noqa: N802
    return PayloadField(default=default, doc=doc)


# ---------------------------------------------------------------------------
# the message classes
# ---------------------------------------------------------------------------
class Registry:
    """A service's methods: name -> request class (which names its reply class)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.requests: dict[str, type[RequestMessage]] = {}

    def add(self, cls: type[RequestMessage]) -> None:
        if cls.method in self.requests:
            raise ValueError(f"{self.service}: two messages for {cls.method!r}")
        self.requests[cls.method] = cls

    def get(self, method: str) -> type[RequestMessage] | None:
        return self.requests.get(method)

    def __iter__(self) -> Any:
        return iter(self.requests.values())

    def __contains__(self, method: object) -> bool:
        return method in self.requests


def _fields_of(cls: type) -> dict[str, Field]:
    out: dict[str, Field] = {}
    for klass in reversed(cls.__mro__):
        out.update(klass.__dict__.get("_own_fields", {}))
    return out


def _py(value: Any, consts: dict[str, Any]) -> str:
    """A name for ``value`` in the generated code's namespace."""
    name = f"_c{len(consts)}"
    consts[name] = value
    return name


class Composite(Field):
    """A field spread over several wire keys (see ``At``): its own ``decode`` and
    ``put`` instead of compiled code."""

    def decode(self, m: dict[str, Any], method: str) -> Any:
        raise NotImplementedError

    def put(self, value: Any, out: dict[str, Any]) -> None:
        raise NotImplementedError


def _compile(cls: type, fields: dict[str, Field]) -> None:
    consts: dict[str, Any] = {"_MISSING": MISSING, "_new": object.__new__, "_cls": cls}
    method = getattr(cls, "method", "") or cls.__name__
    consts["_method"] = method
    dec = ["def from_wire(m, payload=None):", "    o = _new(_cls)"]
    enc = ["def to_wire(self):"]
    enc.append("    d = {'m': _method}" if getattr(cls, "method", "") else "    d = {}")
    init_args, init_body = [], []
    for name, spec in fields.items():
        f = _py(spec, consts)
        if isinstance(spec, Composite):
            dec.append(f"    o.{name} = {f}.decode(m, _method)")
            enc.append(f"    {f}.put(self.{name}, d)")
        elif isinstance(spec, PayloadField):
            dec.append(f"    o.{name} = payload")
        else:
            key = repr(spec.key)
            if spec.required:
                dec.append(f"    v = m.get({key}, _MISSING)")
                dec.append(f"    o.{name} = ({spec.build('v')}) if ({spec.quick('v')}) "
                           f"else {f}.convert(v, _method)")
            else:
                dflt = _py(spec.default, consts)
                dec.append(f"    v = m.get({key}, {dflt})")
                dec.append(f"    if v is not {dflt}:")
                dec.append(f"        v = ({spec.build('v')}) if ({spec.quick('v')}) "
                           f"else {f}.convert(v, _method)")
                dec.append(f"    o.{name} = v")
            if spec.required:
                enc.append(f"    d[{key}] = {f}.encode(self.{name})"
                           if type(spec).encode is not Field.encode
                           else f"    d[{key}] = self.{name}")
            else:
                enc.append(f"    v = self.{name}")
                skip = f"v is not None and v != {dflt}" if spec.sparse else "v is not None"
                enc.append(f"    if {skip} or {spec.nil}: d[{key}] = "
                           + (f"{f}.encode(v)" if type(spec).encode is not Field.encode
                              else "v"))
        if spec.required:
            init_args.append(name)
        else:
            init_args.append(f"{name}={_py(spec.default, consts)}")
        init_body.append(f"    self.{name} = {name}")
    dec.append("    return o")
    enc.append("    return d")
    init = [f"def __init__(self, *, {', '.join(init_args)}):" if init_args
            else "def __init__(self):", *(init_body or ["    pass"])]
    src = "\n".join(dec + enc + init)
    scope: dict[str, Any] = {}
    exec(compile(src, f"<message {cls.__name__}>", "exec"), consts, scope)  # noqa: S102
    cls.from_wire = staticmethod(scope["from_wire"])  # type: ignore[attr-defined]
    cls.to_wire = scope["to_wire"]  # type: ignore[attr-defined]
    cls.__init__ = scope["__init__"]  # type: ignore[misc]


@dataclass_transform(kw_only_default=True, eq_default=True,
                     field_specifiers=(Int, Bool, Str, Bytes, List, Map, Anything, Payload))
class MessageMeta(type):
    """Builds a message class from its field specs (see the module doc)."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any],
                **kw: Any) -> MessageMeta:
        own = {k: v for k, v in ns.items() if isinstance(v, Field)}
        for k in own:
            del ns[k]
        ns["_own_fields"] = own
        ns["__slots__"] = tuple(own)
        cls = super().__new__(mcls, name, bases, ns)
        fields = _fields_of(cls)
        for attr, spec in own.items():
            spec.name = attr
            spec.key = spec.key or attr
        cls._fields = fields  # type: ignore[attr-defined]
        for key, value in kw.items():
            setattr(cls, key, value)
        _compile(cls, fields)
        registry = getattr(cls, "registry", None)
        if kw.get("method") and registry is not None:
            registry.add(cls)
        return cls

    def __init__(cls, name: str, bases: tuple[type, ...], ns: dict[str, Any],
                 **kw: Any) -> None:
        super().__init__(name, bases, ns)


class Message(metaclass=MessageMeta):
    """Base of every message. Instances are slotted, keyword-built values, treated as
    immutable (not enforced: a guard on every attribute set would cost each decode)."""

    __slots__ = ()
    _fields: ClassVar[dict[str, Field]]
    note: ClassVar[str] = ""  # for docs/rpc.md

    @classmethod
    def from_wire(cls: type[_M], m: dict[str, Any], payload: Any = None) -> _M:
        """Validate map ``m`` (and the frame's ``payload``) into a message; replaced
        per class by compiled code."""
        raise NotImplementedError

    def __init__(self, **kw: Any) -> None:  # replaced per class
        raise TypeError(f"{type(self).__name__} declares no fields")

    def to_wire(self) -> dict[str, Any]:  # replaced per class
        return {}

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._fields)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"


class RequestMessage(Message):
    """A request: sent with its method name under ``"m"``."""

    __slots__ = ()
    method: ClassVar[str] = ""
    reply: ClassVar[type[ReplyMessage]]
    registry: ClassVar[Registry | None] = None
    payload_doc: ClassVar[str] = ""


class ReplyMessage(Message):
    __slots__ = ()
    payload_doc: ClassVar[str] = ""


class Empty(ReplyMessage):
    """``{}``"""


def parse_reply(msg: RequestMessage, fields: dict[str, Any]) -> Any:
    """The typed reply to ``msg`` from a reply frame's map (``EPROTO`` when it does not
    fit: the peer broke the protocol)."""
    try:
        return msg.reply.from_wire(fields)
    except OSError as exc:
        raise OSError(errno.EPROTO, f"bad reply to {msg.method}: {exc.strerror}") from None
