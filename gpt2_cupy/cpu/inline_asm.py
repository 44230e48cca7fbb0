"""Inline PTX for the CPU executor: each `asm volatile("..." : outputs : inputs)` of a kernel becomes C++.

A GPU kernel reaches its tensor cores through inline PTX, as the public tutorials write it:

    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));

Here the statement is read (in the preprocessor's output, so asm in macros is found too) and rewritten:
each operand becomes a local variable of its register's type ("r" 32 bits, "l" 64, "f" float, ...), each
PTX instruction a C++ statement on those locals calling include/gpt2cupy/ptx.h, and the outputs are
written back at the end; labels and branches within the statement (a spin loop on an mbarrier, as CUTLASS
writes it) become C++ labels and gotos, named apart for each statement and { } block. The replacement keeps
the statement's line count, so later lines keep their numbers. Plain loads and stores (ld, st) become C++
accesses of the same width and alignment, which the alignment check and the race check see as they see the
kernel's own. An instruction outside the list below is a
CompileError naming it and the kernel's line; so is a wgmma or setmaxnreg instruction in a module compiled
without -arch=sm_90a, which NVRTC refuses too.
"""

import re
from pathlib import Path

from .errors import CompileError
from .toolchain import SOURCE_NAME, source_location

_EXECUTOR = Path(__file__).resolve().parent  # its headers: cuda_builtins.h, include/...

SUPPORTED = ("mma.sync.aligned.{m16n8k8,m16n8k16}.row.col.f32.{tf32 (m16n8k8 only),bf16,f16}.<same>.f32, "
             "mma.sync.aligned.{m16n8k8,m16n8k16}.row.col.f16.f16.f16.f16, "
             "ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans][.shared].b16 and "
             "stmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans][.shared].b16 (their qualifiers in any order), "
             "cp.async.{ca,cg}.shared.global, cp.async.commit_group, cp.async.wait_group, cp.async.wait_all, "
             "cvt.rna[.satfinite].tf32.f32, cvt between u32/s32/u64/s64, cvta[.to].shared, mov, setp, "
             "wgmma.mma_async.sync.aligned.m64n{8..256}k16.f32.{bf16,f16}.<same> with both matrices by descriptor "
             "(K-major or MN-major: imm-trans-a/b 0 or 1), wgmma.mma_async.sync.aligned.m64n{8..256}k8.f32.tf32.tf32 "
             "with both matrices by descriptor (K-major only: no imm-trans operands), "
             "wgmma.fence/commit_group/wait_group.sync.aligned (these four with -arch=sm_90a), "
             "fence.proxy.async, "
             "mbarrier.init/inval.shared[::cta].b64, mbarrier.arrive[.expect_tx][.release.cta].shared[::cta].b64, "
             "mbarrier.expect_tx[.relaxed.cta].shared[::cta].b64, "
             "mbarrier.{try_wait,test_wait}[.parity][.acquire.cta].shared[::cta].b64, "
             "fence.mbarrier_init.release.cluster, "
             "cp.async.bulk.tensor.{1d..5d}.shared::cluster.global[.tile].mbarrier::complete_tx::bytes"
             "[.L2::cache_hint] "
             "(maps from gpt2_cupy.tensor_map), cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
             "[.L2::cache_hint], prefetch.tensormap, prefetch[.global|.local].{L1,L2}, "
             "prefetch.global.L2::{evict_last,evict_normal}, prefetchu.L1, "
             "cp.async.bulk.prefetch.L2.global[.L2::cache_hint] (hints: no effect), "
             "setmaxnreg.{inc,dec}.sync.aligned.u32 (with -arch=sm_90a), "
             "elect.sync, griddepcontrol.{wait,launch_dependents}, "
             "ld and st [.global|.shared[::cta|::cluster]|.local|.const (ld)][.weak|.volatile|.relaxed.<scope>|"
             ".acquire.<scope> (ld)|.release.<scope> (st)][.nc (ld.global)][cache operators, L1/L2 eviction and "
             "prefetch hints, .L2::cache_hint and its policy: no effect][.v2|.v4|.v8 (.v8 and .v4 of 64-bit types, "
             "which alone take .L2::evict_*: .global with -arch=sm_100 and later)].{b,u,s}{8,16,32,64}|.f32|.f64, cvta[.to].{global,local,const}.u64, "
             "selp, bra[.uni] to labels of the statement, and .reg declarations")

# wgmma exists only on sm_90a: NVRTC refuses it for sm_90, the architecture CuPy picks for an H100 or H200.
WGMMA_ARCHITECTURES = ("sm_90a", "compute_90a")

_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b(?:\s*\b(?:volatile|__volatile__|__volatile|inline|__inline__|goto)\b)*\s*\(")
_STRING = re.compile(r'"((?:\\.|[^"\\])*)"')

# C++ type of a register, by operand constraint letter and by PTX type.
_CONSTRAINT_TYPES = {"r": "unsigned int", "l": "unsigned long long", "f": "float", "d": "double",
                     "h": "unsigned short", "n": "long long", "c": "unsigned char"}
_PTX_TYPES = {"pred": "bool", "b16": "unsigned short", "u16": "unsigned short", "s16": "short",
              "b32": "unsigned int", "u32": "unsigned int", "s32": "int", "f32": "float",
              "b64": "unsigned long long", "u64": "unsigned long long", "s64": "long long", "f64": "double"}
_SIZES = {"bool": 1, "unsigned char": 1, "unsigned short": 2, "short": 2, "unsigned int": 4, "int": 4, "float": 4,
          "unsigned long long": 8, "long long": 8, "double": 8}
_UNSIGNED = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_SIGNED = {1: "signed char", 2: "short", 4: "int", 8: "long long"}
# The memory orders of ld and st on the CPU. .relaxed, .acquire and .release are C++ atomics of that order, which
# the race check counts as atomic operations: PTX's strong operations never race with each other either.
# .volatile is a C++ volatile access, what CUDA C++ compiles its volatile accesses to, and the race check counts
# it as the plain access it counts those as.
_LOAD_ORDERS = {"relaxed": "__ATOMIC_RELAXED", "acquire": "__ATOMIC_ACQUIRE"}
_STORE_ORDERS = {"relaxed": "__ATOMIC_RELAXED", "release": "__ATOMIC_RELEASE"}
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_NS = "gpt2cupy::ptx::"


# Instructions whose qualifiers ptxas reads as a set: each qualifier belongs to one category (a pattern here),
# whatever its place, so `ldmatrix.sync.aligned.x4.m8n8.shared.b16` (CUTLASS's order) is the instruction that
# the PTX ISA writes `ldmatrix.sync.aligned.m8n8.x4.shared.b16`. The categories are listed in the ISA's order;
# in_canonical_order puts an opcode's qualifiers in it before the opcode is matched, so each instruction below
# is written in one order only. An instruction with a qualifier of no category, or two of one, is left as
# written: the match then fails and says what the executor runs.
_QUALIFIER_CATEGORIES = {
    "ldmatrix": (r"sync", r"aligned", r"m8n8", r"x[124]", r"trans", r"shared(?:::cta)?", r"b16"),
    "stmatrix": (r"sync", r"aligned", r"m8n8", r"x[124]", r"trans", r"shared(?:::cta)?", r"b16"),
}


def in_canonical_order(opcode):
    """The opcode with its qualifiers in the order _QUALIFIER_CATEGORIES gives its instruction (if it has one)."""
    name, *qualifiers = opcode.split(".")
    categories = _QUALIFIER_CATEGORIES.get(name)
    if categories is None:
        return opcode
    placed = {}
    for qualifier in qualifiers:
        category = next((i for i, pattern in enumerate(categories) if re.fullmatch(pattern, qualifier)), None)
        if category is None or category in placed:
            return opcode
        placed[category] = qualifier
    return ".".join([name] + [placed[i] for i in sorted(placed)])


class AsmError(Exception):
    """An asm statement the executor cannot run; the message says why, without the line."""


def translate(preprocessed, code, architecture=None):
    """The preprocessed kernel text with every asm statement of the kernel's own source made C++.
    architecture: the -arch option's value (sm_90a, ...), which decides whether wgmma compiles."""
    pieces, position = [], 0
    for serial, match in enumerate(_ASM.finditer(preprocessed)):
        if match.start() < position:
            continue
        close = _closing_parenthesis(preprocessed, match.end() - 1)
        file, line = source_location(preprocessed, match.start())
        if file is None or Path(file).resolve().is_relative_to(_EXECUTOR):
            continue  # the executor's own headers hold no PTX
        try:
            replacement = _statement(preprocessed[match.end():close], line, architecture, serial)
        except AsmError as error:
            if file == SOURCE_NAME:
                lines = code.splitlines()
            else:  # a header the kernel includes, kernels/include/mma.cuh say
                lines = Path(file).read_text().splitlines() if Path(file).is_file() else []
            shown = f"\n\nthe line in question:\n{line:4d} | {lines[line - 1]}" if 0 < line <= len(lines) else ""
            raise CompileError(f"{file}:{line}: error: {error}{shown}") from None
        pieces += [preprocessed[position:match.start()], replacement, "\n" * preprocessed.count("\n", match.start(), close)]
        position = close + 1
    return "".join(pieces) + preprocessed[position:]


def _closing_parenthesis(text, open_index):
    depth, index = 0, open_index
    while index < len(text):
        character = text[index]
        if character == '"':
            index = _STRING.match(text, index).end()
            continue
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth == 0:
            return index
        index += 1
    raise AsmError("an asm statement without its closing parenthesis")


def _split_top_level(text, separator):
    """Parts of `text` between the separators outside parentheses, brackets, braces and strings."""
    parts, depth, start, index = [], 0, 0, 0
    while index < len(text):
        character = text[index]
        if character == '"':
            index = _STRING.match(text, index).end()
            continue
        if character in "([{":
            depth += 1
        elif character in ")]}":
            depth -= 1
        elif character == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
        index += 1
    return parts + [text[start:]]


class _Operand:
    """One C++ operand of the asm statement: constraint, expression, and the local that stands for it."""

    def __init__(self, text, index):
        match = re.fullmatch(r'\s*(?:\[\s*(?P<name>\w+)\s*\]\s*)?(?P<constraint>(?:"(?:\\.|[^"\\])*"\s*)+)\((?P<expression>.*)\)\s*',
                             text, re.S)
        if not match:
            raise AsmError(f"asm operand `{text.strip()}` is not of the form \"constraint\"(expression)")
        self.name, self.expression, self.index = match.group("name"), match.group("expression"), index
        self.constraint = "".join(_STRING.findall(match.group("constraint")))
        letters = [c for c in self.constraint if c in _CONSTRAINT_TYPES]
        if not letters:
            raise AsmError(f'asm operand constraint "{self.constraint}" is not one of "r", "l", "f", "d", "h", "n"')
        self.type = _CONSTRAINT_TYPES[letters[0]]
        self.local = f"gpt2cupy_asm_{index}"


def _qualifiers_of(kind):
    """The qualifiers PTX gives ld or st, by what they say; each may appear once, in any order."""
    return {
        "state space": ("global", "shared", "shared::cta", "shared::cluster", "local")
                       + (("const",) if kind == "ld" else ()),
        "memory order": ("weak", "volatile", "relaxed", "acquire" if kind == "ld" else "release"),
        "scope": ("cta", "cluster", "gpu", "sys"),
        "vector width": ("v2", "v4", "v8"),
        "cache operator": ("ca", "cg", "cs", "lu", "cv") if kind == "ld" else ("wb", "cg", "cs", "wt"),
        "non-coherent": ("nc",) if kind == "ld" else (),
        "L1 eviction priority": ("L1::evict_normal", "L1::evict_unchanged", "L1::evict_first", "L1::evict_last",
                                 "L1::no_allocate"),
        "L2 eviction priority": ("L2::evict_normal", "L2::evict_first", "L2::evict_last"),
        "prefetch size": ("L2::64B", "L2::128B", "L2::256B") if kind == "ld" else (),
        "cache hint": ("L2::cache_hint",),
    }


# Bytes of each type ld and st move, and whether it is signed (sign-extended into a wider register).
_MEMORY_TYPES = {f"{kind}{bits}": (bits // 8, kind == "s") for kind in "bus" for bits in (8, 16, 32, 64)}
_MEMORY_TYPES.update(f32=(4, False), f64=(8, False))


def _at_least_sm_100(architecture):
    number = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", architecture or "")
    return bool(number) and int(number.group(1)) >= 100


class _MemoryAccess:
    """What one ld or st instruction asks, read from its name: the state space, the memory order and scope, the
    vector width and the type. Cache operators, eviction priorities, prefetch sizes and cache policies steer a
    GPU's caches only; they are checked as PTX allows them, then have no effect on the CPU."""

    def __init__(self, opcode, architecture):
        self.opcode = opcode
        self.kind, *qualifiers, type_name = opcode.split(".")
        if type_name not in _MEMORY_TYPES:
            hint = (": PTX has no such type for ld and st; move half-precision values as their bits, .b16 in an "
                    '"h" register' if type_name in ("f16", "bf16", "f16x2", "bf16x2") else
                    ": the CPU executor runs no 128-bit registers" if type_name == "b128" else "")
            raise AsmError(f"the CPU executor does not run '{opcode}': .{type_name} is not a type it loads or stores"
                           f"{hint}. It runs: {SUPPORTED}")
        self.size, self.signed = _MEMORY_TYPES[type_name]
        self.type_name = type_name
        found = {}
        for qualifier in qualifiers:
            category = next((c for c, names in _qualifiers_of(self.kind).items() if qualifier in names), None)
            if category is None:
                raise AsmError(f"the CPU executor does not run '{opcode}': .{qualifier} is not a qualifier of "
                               f"{self.kind} it knows. It runs: {SUPPORTED}")
            if category in found:
                raise AsmError(f"{opcode}: two {category} qualifiers (.{found[category]} and .{qualifier})")
            found[category] = qualifier
        self.space = found.get("state space", "generic")
        self.shared = self.space.startswith("shared")
        self.order, self.scope = found.get("memory order", "weak"), found.get("scope")
        self.count = {"v2": 2, "v4": 4, "v8": 8}.get(found.get("vector width"), 1)
        self.cache_hint = "cache hint" in found
        self.check(found, architecture)

    def check(self, found, architecture):
        """Refuse what PTX (and so ptxas) refuses, so that what runs here also compiles for a GPU."""
        strong = self.order in ("relaxed", "acquire", "release")
        if strong and self.scope is None:
            raise AsmError(f"{self.opcode}: .{self.order} needs a scope (.cta, .cluster, .gpu or .sys)")
        if not strong and self.scope is not None:
            raise AsmError(f"{self.opcode}: a scope (.{self.scope}) goes with .relaxed, .acquire or .release only")
        if self.order != "weak" and (self.space not in ("generic", "global") and not self.shared
                                     or "cache operator" in found or "non-coherent" in found):
            raise AsmError(f"{self.opcode}: .{self.order} is for .global and .shared (or generic) addresses, "
                           "without a cache operator or .nc")
        if "non-coherent" in found and self.space != "global":
            raise AsmError(f"{self.opcode}: .nc is for ld.global only")
        if ("prefetch size" in found or self.cache_hint) and self.space not in ("generic", "global"):
            raise AsmError(f"{self.opcode}: prefetch sizes and .L2::cache_hint are for global memory only")
        if self.count * self.size == 32:  # 256 bits: .v8 of 32-bit types, .v4 of 64-bit ones
            if self.space not in ("generic", "global") or not _at_least_sm_100(architecture):
                raise AsmError(f"{self.opcode}: 256-bit loads and stores are for global memory on sm_100 and "
                               f"later (-arch={architecture or '...'} here); compile with -arch=sm_100 or use .v4 "
                               "of 32-bit types")
        elif self.count == 8:
            raise AsmError(f"{self.opcode}: .v8 is for 32-bit types only (.b32, .u32, .s32, .f32)")
        elif "L2 eviction priority" in found:  # as ptxas 13 says for sm_90
            raise AsmError(f"{self.opcode}: .{found['L2 eviction priority']} is for 256-bit loads and stores only "
                           "(.v8 of 32-bit types, .v4 of 64-bit ones); elsewhere use .L2::cache_hint and a policy")

    @property
    def sinks_allowed(self):
        """Whether PTX lets `_` stand for an element (not read, or not written): in 256-bit accesses only."""
        return self.count * self.size == 32


def _statement(inside, line, architecture=None, serial=0):
    """The C++ block standing for one asm statement (the text between its parentheses); `serial` tells its labels
    from those of the function's other statements."""
    sections = _split_top_level(inside, ":")
    template = "".join(bytes(s, "utf-8").decode("unicode_escape") for s in _STRING.findall(sections[0]))
    if len(sections) > 1:  # an asm statement with operands writes a register's % as %%
        template = template.replace("%%", "%")
    outputs = [t for t in _split_top_level(sections[1], ",") if t.strip()] if len(sections) > 1 else []
    inputs = [t for t in _split_top_level(sections[2], ",") if t.strip()] if len(sections) > 2 else []
    operands = [_Operand(text, index) for index, text in enumerate(outputs + inputs)]
    for operand in operands[:len(outputs)]:
        if not operand.constraint.startswith(("=", "+")):
            raise AsmError(f'asm output operand "{operand.constraint}" must start with "=" or "+"')
    body = _Body(operands, line, architecture, serial).translate(template)
    declarations = " ".join(f"{o.type} {o.local}{{}};" for o in operands)
    reads = " ".join(f"{o.local} = {_NS}bits<{o.type}>({o.expression});"
                     for o in operands if o.index >= len(outputs) or o.constraint.startswith("+"))
    writes = " ".join(f"{_NS}assign({o.expression}, {o.local});" for o in operands[:len(outputs)])
    return f"do {{ {declarations} {reads} {body} {writes} }} while (0)"


class _Body:
    """The PTX template of one asm statement, as C++ statements."""

    def __init__(self, operands, line, architecture=None, serial=0):
        self.operands = operands
        self.line = line
        self.architecture = architecture
        self.serial = serial
        self.registers = {}  # PTX register name -> (C++ name, C++ type), from .reg declarations
        self.labels = {}     # (scope, PTX label) -> C++ label
        self.scopes = [0]    # the { } blocks the instruction in hand lies in, innermost last

    def translate(self, template):
        template = re.sub(r"//[^\n]*|/\*.*?\*/", " ", template, flags=re.S)
        pieces = list(self.pieces(template))
        # Labels are known in their { } block, also above the place they mark (a branch forward): first find them.
        scopes, count = [0], 0
        for kind, text in pieces:
            if kind == "{":
                count += 1
                scopes.append(count)
            elif kind == "}":
                scopes.pop()
            elif kind == "label":
                self.labels[(scopes[-1], text)] = f"gpt2cupy_label_{self.serial}_{scopes[-1]}_{text.lstrip('$%')}"
        statements, count = [], 0
        for kind, text in pieces:
            if kind == "{":
                count += 1
                self.scopes.append(count)
                statements.append("{")
            elif kind == "}":
                self.scopes.pop()
                statements.append("}")
            elif kind == "label":
                statements.append(f"{self.labels[(self.scopes[-1], text)]}: ;")
            else:
                statements.append(self.instruction(text))
        return " ".join(statements)

    @staticmethod
    def pieces(template):
        """The template's braces, labels (`NAME:`) and instructions, in order, as (kind, text)."""
        index = 0
        while index < len(template):
            character = template[index]
            label = re.compile(r"([A-Za-z_$%][\w$]*)\s*:(?!:)").match(template, index)
            if character.isspace():
                index += 1
            elif character in "{}":
                yield character, character
                index += 1
            elif label:
                yield "label", label.group(1)
                index = label.end()
            else:
                end = template.find(";", index)
                end = len(template) if end < 0 else end
                yield "instruction", template[index:end].strip()
                index = end + 1

    def label(self, name):
        """The C++ label a branch to PTX label `name` goes to: the one of the innermost block that has it."""
        for scope in reversed(self.scopes):
            if (scope, name) in self.labels:
                return self.labels[(scope, name)]
        raise AsmError(f"bra: no label '{name}' in the asm statement's blocks around the branch")

    def instruction(self, text):
        guard = re.match(r"@(!?)\s*(%?\w+)\s+", text)
        if guard:
            negate, predicate = guard.groups()
            condition = f"!{self.scalar(predicate)}" if negate else self.scalar(predicate)
            return f"if ({condition}) {{ {self.instruction(text[guard.end():])} }}"
        opcode, rest = (re.split(r"\s+", text, maxsplit=1) + [""])[:2]
        opcode = in_canonical_order(opcode)
        operands = [o.strip() for o in _split_top_level(rest, ",")] if rest.strip() else []
        if opcode == ".reg":
            return self.declare(rest)
        for pattern, translate in self.INSTRUCTIONS:
            match = re.fullmatch(pattern, opcode)
            if match:
                return translate(self, match, operands)
        raise AsmError(f"the CPU executor does not know the PTX instruction '{opcode}' (in an asm statement). "
                       f"It runs: {SUPPORTED}")

    # ---- operands ----
    def scalar(self, text):
        """The C++ expression of a scalar PTX operand: %N, %[name], a .reg register, or a number."""
        text = text.strip()
        number = re.fullmatch(r"(-?)(0[xX][0-9a-fA-F]+|\d+)[uU]?", text)
        if number:
            return f"({text.rstrip('uU')}ll)"
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", text):
            return f"{_NS}bits<float>(0x{text[2:]}u)"
        index = re.fullmatch(r"%(\d+)", text)
        if index:
            if int(index.group(1)) >= len(self.operands):
                raise AsmError(f"asm template names operand {text}, but the statement has {len(self.operands)}")
            return self.operands[int(index.group(1))].local
        name = re.fullmatch(r"%\[(\w+)\]", text)
        if name:
            for operand in self.operands:
                if operand.name == name.group(1):
                    return operand.local
            raise AsmError(f"asm template names operand {text}, which the statement does not declare")
        if text.lstrip("%") == "laneid":
            return f"{_NS}lane()"
        if text in self.registers:
            return self.registers[text][0]
        raise AsmError(f"PTX operand '{text}' is neither an asm operand (%0, %1, ...) nor a declared .reg register")

    def register_type(self, text):
        """The C++ type of the register a scalar operand names (its constraint's, or its .reg declaration's); None
        for a number."""
        text = text.strip()
        local = self.scalar(text)
        for operand in self.operands:
            if operand.local == local:
                return operand.type
        return self.registers[text][1] if text in self.registers else None

    def vector(self, text, length, what):
        return [self.scalar(e) for e in self.vector_elements(text, length, what)]

    def vector_elements(self, text, length, what):
        """The operands in a vector operand {a, b, ...} of `length` registers, as written."""
        if not (text.startswith("{") and text.endswith("}")):
            raise AsmError(f"{what}: expected a vector operand {{...}} of {length} registers, got '{text}'")
        elements = [e.strip() for e in text[1:-1].split(",")]
        if len(elements) != length:
            raise AsmError(f"{what}: expected {length} registers in '{text}', got {len(elements)}")
        return elements

    def address(self, text, what):
        """[register], [register+offset], [register-offset] or [register+-offset], as a 64-bit C++ value."""
        match = re.fullmatch(r"\[\s*([^\]+\-]+?)\s*(?:([+-])\s*(-?)\s*(\w+))?\s*\]", text)
        if not match:
            raise AsmError(f"{what}: expected an address operand [register] or [register+offset], got '{text}'")
        base, sign, negative, offset = match.groups()
        value = f"{_NS}bits<unsigned long long>({self.scalar(base)})"
        return f"({value} {sign} (unsigned long long){self.scalar(negative + offset)})" if sign else value

    def declare(self, text):
        match = re.fullmatch(r"\s*\.(\w+)\s+(.+)", text)
        if not match or match.group(1) not in _PTX_TYPES:
            raise AsmError(f"the CPU executor does not know the PTX declaration '.reg {text.strip()}'")
        cpp_type, declared = _PTX_TYPES[match.group(1)], []
        for name in (n.strip() for n in match.group(2).split(",")):
            ranged = re.fullmatch(r"(\w+)<(\d+)>", name)
            names = [f"{ranged.group(1)}{i}" for i in range(int(ranged.group(2)))] if ranged else [name]
            for each in names:
                self.registers[each] = (f"gpt2cupy_reg_{re.sub(r'[^0-9A-Za-z_]', '_', each)}", cpp_type)
                declared.append(f"{cpp_type} {self.registers[each][0]}{{}};")
        return " ".join(declared)

    def expect(self, operands, count, opcode):
        if len(operands) != count:
            raise AsmError(f"{opcode}: expected {count} operands, got {len(operands)}")

    # ---- instructions ----
    def mma(self, match, operands):
        shape, a_type, b_type = match.group("shape"), match.group("a"), match.group("b")
        k = 8 if shape == "m16n8k8" else 16
        # C and D of f16 (two to a 32-bit register) go with f16 A and B only, C and D of one type
        half_accumulators = match.group("d") == "f16"
        if (a_type != b_type or (a_type == "tf32" and k != 8) or match.group("c") != match.group("d")
                or (half_accumulators and a_type != "f16")):
            raise AsmError(f"the CPU executor does not run '{match.group(0)}': it runs mma.sync with A and B of one "
                           "type: tf32 at m16n8k8, bf16 or f16 at m16n8k8 and m16n8k16, with f32 C and D; and f16 A "
                           "and B with f16 C and D")
        per_register = 1 if a_type == "tf32" else 2
        a_count, b_count = 16 * k // 32 // per_register, k * 8 // 32 // per_register
        self.expect(operands, 4, "mma.sync")
        accumulators = 2 if half_accumulators else 4
        d = self.vector(operands[0], accumulators, "mma.sync D")
        a = self.vector(operands[1], a_count, "mma.sync A")
        b = self.vector(operands[2], b_count, "mma.sync B")
        c = self.vector(operands[3], accumulators, "mma.sync C")
        as_bits = lambda values, kind: ", ".join(f"{_NS}bits<{kind}>({v})" for v in values)  # noqa: E731
        multiply = f"{_NS}Tile<{k}, {_NS}Input::{a_type}>::multiply"
        inputs = (f"const unsigned gpt2cupy_a[{a_count}] = {{{as_bits(a, 'unsigned')}}}; "
                  f"const unsigned gpt2cupy_b[{b_count}] = {{{as_bits(b, 'unsigned')}}}; ")
        if half_accumulators:
            return (f"{{ {inputs}const unsigned gpt2cupy_c[2] = {{{as_bits(c, 'unsigned')}}}; unsigned gpt2cupy_d[2]; "
                    f"{_NS}multiply_half_accumulators<{k}>(gpt2cupy_d, gpt2cupy_a, gpt2cupy_b, gpt2cupy_c, {self.line}); "
                    + " ".join(f"{_NS}assign({target}, gpt2cupy_d[{i}]);" for i, target in enumerate(d)) + " }")
        return (f"{{ {inputs}const float gpt2cupy_c[4] = {{{as_bits(c, 'float')}}}; float gpt2cupy_d[4]; "
                f"{multiply}(gpt2cupy_d, gpt2cupy_a, gpt2cupy_b, gpt2cupy_c, {self.line}); "
                + " ".join(f"{_NS}assign({target}, gpt2cupy_d[{i}]);" for i, target in enumerate(d)) + " }")

    def ldmatrix(self, match, operands):
        count = int(match.group("count"))
        self.expect(operands, 2, "ldmatrix")
        registers = self.vector(operands[0], count, "ldmatrix")
        address = self.address(operands[1], "ldmatrix")
        transpose, shared = str(bool(match.group("trans"))).lower(), str(bool(match.group("shared"))).lower()
        return (f"{{ unsigned gpt2cupy_r[4]; {_NS}ldmatrix(gpt2cupy_r, {count}, {transpose}, {address}, {shared}, {self.line}); "
                + " ".join(f"{_NS}assign({target}, gpt2cupy_r[{i}]);" for i, target in enumerate(registers)) + " }")

    def stmatrix(self, match, operands):
        count = int(match.group("count"))
        self.expect(operands, 2, "stmatrix")
        address = self.address(operands[0], "stmatrix")
        registers = self.vector(operands[1], count, "stmatrix")
        transpose, shared = str(bool(match.group("trans"))).lower(), str(bool(match.group("shared"))).lower()
        values = ", ".join(f"{_NS}bits<unsigned>({register})" for register in registers)
        return (f"{{ const unsigned gpt2cupy_r[4] = {{{values}}}; "
                f"{_NS}stmatrix(gpt2cupy_r, {count}, {transpose}, {address}, {shared}, {self.line}); }}")

    def cp_async(self, match, operands):
        fixed = 3 + bool(match.group("hint"))
        if not fixed <= len(operands) <= fixed + 1:
            raise AsmError(f"{match.group(0)}: expected [destination], [source], size, an optional source size "
                           f"or ignore-src predicate{', and a cache policy' if match.group('hint') else ''}")
        destination = self.address(operands[0], "cp.async destination")
        source = self.address(operands[1], "cp.async source")
        size = self.scalar(operands[2])
        if len(operands) == fixed + 1:  # the source size, or a predicate that ignores the source
            extra = operands[3]
            if self.registers.get(extra.strip(), ("", ""))[1] == "bool":
                source_size = f"({self.scalar(extra)} ? 0ull : (unsigned long long){size})"
            else:
                source_size = f"{_NS}bits<unsigned long long>({self.scalar(extra)})"
        else:
            source_size = size
        cache_global = str(match.group("cache") == "cg").lower()
        return f"{_NS}cp_async({destination}, {source}, (unsigned){size}, {source_size}, {cache_global}, {self.line});"

    def commit_group(self, match, operands):
        self.expect(operands, 0, "cp.async.commit_group")
        return f"{_NS}cp_async_commit_group();"

    def wait_group(self, match, operands):
        self.expect(operands, 1, "cp.async.wait_group")
        return f"{_NS}cp_async_wait_group((unsigned){self.scalar(operands[0])});"

    def wait_all(self, match, operands):
        self.expect(operands, 0, "cp.async.wait_all")
        return f"{_NS}cp_async_wait_all();"

    def cvt_tf32(self, match, operands):
        self.expect(operands, 2, match.group(0))
        satfinite = str(bool(match.group("satfinite"))).lower()
        return (f"{_NS}assign({self.scalar(operands[0])}, "
                f"{_NS}cvt_rna_tf32({_NS}bits<float>({self.scalar(operands[1])}), {satfinite}));")

    def cvt_integer(self, match, operands):
        self.expect(operands, 2, match.group(0))
        to, source = _PTX_TYPES[match.group("to")], _PTX_TYPES[match.group("from")]
        return (f"{_NS}assign({self.scalar(operands[0])}, "
                f"({to})({source}){_NS}bits<{source}>({self.scalar(operands[1])}));")

    def cvta(self, match, operands):
        self.expect(operands, 2, match.group(0))
        value = f"{_NS}bits<unsigned long long>({self.scalar(operands[1])})"
        if match.group("to"):
            converted = f"{_NS}to_shared((const void*){value})"
        else:
            converted = (f"(unsigned long long){_NS}from_shared({value}, \"cvta.shared: not a shared-memory address\", "
                         f"{self.line})")
        return f"{_NS}assign({self.scalar(operands[0])}, ({_PTX_TYPES[match.group('type')]}){converted});"

    def mov(self, match, operands):
        self.expect(operands, 2, match.group(0))
        cpp_type = _PTX_TYPES[match.group("type")]
        return f"{_NS}assign({self.scalar(operands[0])}, {_NS}bits<{cpp_type}>({self.scalar(operands[1])}));"

    def setp(self, match, operands):
        self.expect(operands, 3, match.group(0))
        cpp_type = _PTX_TYPES[match.group("type")]
        left, right = (f"{_NS}bits<{cpp_type}>({self.scalar(o)})" for o in operands[1:])
        return f"{self.scalar(operands[0])} = ({left} {_COMPARISONS[match.group('comparison')]} {right});"

    def cvta_pointer(self, match, operands):
        # Global, local and constant addresses are the generic pointers themselves here (local memory is the
        # thread's stack, __constant__ an ordinary variable): 64 bits, which a .u32 address cannot hold.
        self.expect(operands, 2, match.group(0))
        if match.group("type") == "u32":
            raise AsmError(f"{match.group(0)}: the CPU executor's {match.group('space')} addresses are 64-bit "
                           "pointers: use .u64")
        return f"{_NS}assign({self.scalar(operands[0])}, {_NS}bits<unsigned long long>({self.scalar(operands[1])}));"

    # ---- plain loads and stores ----
    def load_or_store(self, match, operands):
        """ld d, [a] (and st [a], b): the access through a struct as wide and as aligned as the whole vector, so
        that a misaligned address stops the thread (the alignment check the kernel is compiled with) as it stops a
        GPU, and element by element, so that each element is a load or store the race check sees."""
        access = _MemoryAccess(match.group(0), self.architecture)
        self.expect(operands, 2 + access.cache_hint, match.group(0))
        registers, address = (operands[0], operands[1]) if access.kind == "ld" else (operands[1], operands[0])
        elements = self.elements(registers, access)
        # The cache policy is a 64-bit register the GPU's L2 reads as a hint; here it is only read.
        statements = [f"(void){self.scalar(operands[2])};"] if access.cache_hint else []
        qualifiers = ("const " if access.kind == "ld" else "") + ("volatile " if access.order == "volatile" else "")
        location = self.address(address, access.opcode)
        if access.shared:
            location = (f"{_NS}from_shared({location}, \"{access.opcode}: the address is not a shared-memory address "
                        f"(from __cvta_generic_to_shared or cvta.to.shared)\", {self.line})")
        statements += [f"struct alignas({access.count * access.size}) gpt2cupy_vector "
                       f"{{ {_UNSIGNED[access.size]} element[{access.count}]; }};",
                       f"{qualifiers}gpt2cupy_vector* gpt2cupy_at = "
                       f"({qualifiers}gpt2cupy_vector*)({location});"]
        if access.order == "release" and access.scope in ("gpu", "sys"):
            # A release to other blocks: what the thread wrote before is published first, as __threadfence() then
            # a store does it (and as the race check reads it: a fence, then an atomic operation).
            statements.append("__threadfence();")
        for index, register in enumerate(elements):
            if register is not None:
                place = f"gpt2cupy_at->element[{index}]"
                statements.append(self.load(register, place, access) if access.kind == "ld"
                                  else self.store(place, register, access))
        return "{ " + " ".join(statements) + " }"

    def elements(self, text, access):
        """The registers of a vector operand {a, b, ...} (None for a sink `_`), or of a scalar one."""
        if access.count == 1:
            return [text]
        elements = self.vector_elements(text, access.count, access.opcode)
        if "_" in elements and not access.sinks_allowed:
            raise AsmError(f"{access.opcode}: the sink _ stands for an element only in 256-bit loads and stores")
        return [None if e == "_" else e for e in elements]

    def register_size(self, text, access, cpp_type):
        """Bytes of the register, which PTX allows wider than the type (integers are extended into it and cut
        from it), but a floating-point register only as wide."""
        size = _SIZES.get(cpp_type, 0)
        if size < access.size or cpp_type == "bool" or (cpp_type in ("float", "double") and size != access.size):
            raise AsmError(f"{access.opcode}: the register '{text}' ({cpp_type}) cannot hold .{access.type_name}")
        return size

    def load(self, register, place, access):
        cpp_type = self.register_type(register)
        if cpp_type is None:
            raise AsmError(f"{access.opcode}: the destination '{register}' is not a register")
        size = self.register_size(register, access, cpp_type)
        order = _LOAD_ORDERS.get(access.order)
        value = f"__atomic_load_n(&{place}, {order})" if order else f"({_UNSIGNED[access.size]}){place}"
        if size > access.size:  # .s types sign-extend into a wider register, the others zero-extend
            value = f"({_UNSIGNED[size]})" + (f"({_SIGNED[access.size]})" if access.signed else "") + value
        return f"{_NS}assign({self.scalar(register)}, {value});"

    def store(self, place, register, access):
        cpp_type = self.register_type(register)  # None for a number
        size = self.register_size(register, access, cpp_type) if cpp_type else access.size
        value = f"({_UNSIGNED[access.size]}){_NS}bits<{_UNSIGNED[size]}>({self.scalar(register)})"  # the low bits
        order = _STORE_ORDERS.get(access.order)
        return f"__atomic_store_n(&{place}, {value}, {order});" if order else f"{place} = {value};"

    # ---- Hopper: warpgroup products and the async proxy ----
    def require_sm_90a(self, opcode):
        if self.architecture not in WGMMA_ARCHITECTURES:
            given = f"-arch={self.architecture}" if self.architecture else "no -arch option"
            raise AsmError(f"'{opcode}' needs the architecture sm_90a ({given} here): NVRTC refuses wgmma and "
                           "setmaxnreg for sm_90, the architecture it picks for an H100 or H200. Compile with "
                           "options=(\"-arch=sm_90a\",)")

    def wgmma_mma(self, match, operands):
        self.require_sm_90a(match.group(0))
        n, k, d_type = int(match.group("n")), int(match.group("k")), match.group("d")
        a_type, b_type = match.group("a"), match.group("b")
        depth = 8 if a_type == "tf32" else 16
        if (n % 8 != 0 or not 8 <= n <= 256 or d_type != "f32" or a_type != b_type
                or a_type not in ("bf16", "f16", "tf32") or k != depth):
            raise AsmError(f"the CPU executor does not run '{match.group(0)}': it runs wgmma.mma_async m64nNk16 "
                           "(N a multiple of 8 up to 256) with f32 D and A, B both bf16 or both f16, and m64nNk8 "
                           "with f32 D and A, B both tf32")
        # A in registers: one operand fewer than the descriptor form, and a vector where a-desc stands
        if operands[1:2] and operands[1].startswith("{"):
            raise AsmError(f"{match.group(0)}: the CPU executor runs wgmma.mma_async with A in shared memory (a "
                           "descriptor), not A in registers")
        if a_type == "tf32":
            if len(operands) == 8:
                raise AsmError(f"{match.group(0)}: .tf32 operands are K-major only: PTX gives the .tf32 variant no "
                               "imm-trans-a, imm-trans-b operands (d, a-desc, b-desc, scale-d, imm-scale-a, "
                               "imm-scale-b)")
            self.expect(operands, 6, "wgmma.mma_async .tf32")
        else:
            self.expect(operands, 8, "wgmma.mma_async")
        d = self.vector(operands[0], n // 2, "wgmma.mma_async D")
        a_descriptor, b_descriptor, scale_d, *immediates = (self.scalar(o) for o in operands[1:])
        if a_type == "tf32":
            immediates += ["0", "0"]   # K-major: no transposes
        as_float = ", ".join(f"{_NS}bits<float>({v})" for v in d)
        return (f"{{ float gpt2cupy_d[{n // 2}] = {{{as_float}}}; "
                f"{_NS}wgmma<{n}, {_NS}Input::{a_type}>(gpt2cupy_d, {_NS}bits<unsigned long long>({a_descriptor}), "
                f"{_NS}bits<unsigned long long>({b_descriptor}), ({scale_d}) != 0, "
                + ", ".join(f"(long long)({v})" for v in immediates) + f", {self.line}); "
                + " ".join(f"{_NS}assign({target}, gpt2cupy_d[{i}]);" for i, target in enumerate(d)) + " }")

    def wgmma_fence(self, match, operands):
        self.require_sm_90a(match.group(0))
        self.expect(operands, 0, match.group(0))
        return f"{_NS}wgmma_fence({self.line});"

    def wgmma_commit_group(self, match, operands):
        self.require_sm_90a(match.group(0))
        self.expect(operands, 0, match.group(0))
        return f"{_NS}wgmma_commit_group({self.line});"

    def wgmma_wait_group(self, match, operands):
        self.require_sm_90a(match.group(0))
        self.expect(operands, 1, match.group(0))
        return f"{_NS}wgmma_wait_group((unsigned long long){self.scalar(operands[0])}, {self.line});"

    def fence_proxy_async(self, match, operands):
        # Orders a thread's ordinary writes to memory before the async proxy (wgmma, bulk copies) reads it. The
        # executor has one memory and no proxies: the barrier a kernel needs after the fence does the ordering.
        self.expect(operands, 0, match.group(0))
        return ";"

    # ---- branches within the statement ----
    def branch(self, match, operands):
        self.expect(operands, 1, match.group(0))
        return f"goto {self.label(operands[0])};"

    def selp(self, match, operands):
        self.expect(operands, 4, match.group(0))
        cpp_type = _PTX_TYPES[match.group("type")]
        chosen, other = (f"{_NS}bits<{cpp_type}>({self.scalar(o)})" for o in operands[1:3])
        return f"{_NS}assign({self.scalar(operands[0])}, ({self.scalar(operands[3])}) ? {chosen} : {other});"

    # ---- Hopper: mbarriers, bulk copies, warp specialization ----
    def sink_or_scalar(self, text):
        """None for the sink `_` (a result nobody reads), else the operand's C++ expression."""
        return None if text.strip() == "_" else self.scalar(text)

    def mbarrier_init(self, match, operands):
        self.expect(operands, 2, match.group(0))
        return (f"{_NS}mbarrier_init({self.address(operands[0], 'mbarrier.init')}, "
                f"(unsigned long long){self.scalar(operands[1])}, {self.line});")

    def mbarrier_arrive(self, match, operands):
        expect_tx = bool(match.group("expect_tx"))
        if expect_tx:
            self.expect(operands, 3, match.group(0))
        elif len(operands) not in (2, 3):
            raise AsmError(f"{match.group(0)}: expected state (or _), [address] and an optional count")
        address = self.address(operands[1], match.group(0))
        arrivals = "1" if expect_tx or len(operands) == 2 else f"(unsigned long long){self.scalar(operands[2])}"
        bytes_ = f"(unsigned long long){self.scalar(operands[2])}" if expect_tx else "0"
        call = f"{_NS}mbarrier_arrive({address}, {arrivals}, {bytes_}, {self.line})"
        state = self.sink_or_scalar(operands[0])
        return f"{_NS}assign({state}, {call});" if state else f"{call};"

    def mbarrier_expect_tx(self, match, operands):
        self.expect(operands, 2, match.group(0))
        return (f"{_NS}mbarrier_arrive({self.address(operands[0], match.group(0))}, 0, "
                f"(unsigned long long){self.scalar(operands[1])}, {self.line});")

    def mbarrier_wait(self, match, operands):
        hint = match.group("kind") == "try_wait"   # try_wait may name a time limit, which the executor needs not
        if not 3 <= len(operands) <= 3 + hint:
            what = "parity" if match.group("parity") else "state"
            raise AsmError(f"{match.group(0)}: expected a predicate, [address], {what}"
                           f"{' and an optional time limit' if hint else ''}")
        address = self.address(operands[1], match.group(0))
        test = "mbarrier_test_wait" if match.group("parity") else "mbarrier_test_wait_state"
        return (f"{_NS}assign({self.scalar(operands[0])}, {_NS}{test}({address}, "
                f"(unsigned long long){self.scalar(operands[2])}, {self.line}));")

    def mbarrier_inval(self, match, operands):
        self.expect(operands, 1, match.group(0))
        return f"{_NS}mbarrier_inval({self.address(operands[0], match.group(0))}, {self.line});"

    def no_effect_here(self, match, operands):
        # fence.mbarrier_init (a one-block cluster: the __syncthreads() after it does the ordering),
        # prefetch.tensormap (a hint), and griddepcontrol: the executor runs a launch to its end before the
        # next starts, so a kernel's wait for the one before it has always been answered, and letting the
        # next one start early changes nothing
        return ";"

    def prefetch(self, match, operands):
        # A hint that the line at the address will be read: the CPU has its own caches, which it fills itself.
        self.expect(operands, 1, match.group(0))
        return f"(void){self.address(operands[0], match.group(0))};"

    def bulk_prefetch(self, match, operands):
        # cp.async.bulk.prefetch.L2.global [address], size (, cache policy): a hint too, but its size and address
        # must be multiples of 16 bytes, which the executor checks as for cp.async.bulk.
        self.expect(operands, 2 + bool(match.group("hint")), match.group(0))
        return (f"{_NS}bulk_prefetch({self.address(operands[0], match.group(0))}, "
                f"(unsigned long long){self.scalar(operands[1])}, {self.line});")

    def bulk_tensor_copy(self, match, operands):
        dimensions = int(match.group("dimensions"))
        self.expect(operands, 3 + bool(match.group("hint")), match.group(0))
        destination = self.address(operands[0], match.group(0))
        source = operands[1].strip()
        parts = _split_top_level(source[1:-1], ",") if source.startswith("[") and source.endswith("]") else []
        if len(parts) != 2:
            raise AsmError(f"{match.group(0)}: expected the source as [tensorMap, {{coordinates}}], got '{source}'")
        coordinates = self.vector(parts[1].strip(), dimensions, match.group(0) + " coordinates")
        coordinate_list = ", ".join(f"(int){_NS}bits<unsigned>({c})" for c in coordinates)
        map_address = f"{_NS}bits<unsigned long long>({self.scalar(parts[0])})"
        return (f"{{ const int gpt2cupy_coordinates[5] = {{{coordinate_list}}}; "
                f"{_NS}bulk_tensor_copy({dimensions}, {destination}, {map_address}, gpt2cupy_coordinates, "
                f"{self.address(operands[2], match.group(0))}, {self.line}); }}")

    def bulk_copy(self, match, operands):
        self.expect(operands, 4 + bool(match.group("hint")), match.group(0))
        destination, source, barrier = (self.address(operands[k], match.group(0)) for k in (0, 1, 3))
        return (f"{_NS}bulk_copy({destination}, {source}, (unsigned long long){self.scalar(operands[2])}, {barrier}, "
                f"{self.line});")

    def setmaxnreg(self, match, operands):
        # Moves registers between a block's warpgroups on a GPU; the CPU has none to move. NVRTC refuses a count
        # that is not a multiple of 8 in 24 .. 256.
        self.require_sm_90a(match.group(0))
        self.expect(operands, 1, match.group(0))
        count = operands[0].strip()
        value = re.fullmatch(r"\d+", count) and int(count)
        if value is None or value is False:
            raise AsmError(f"{match.group(0)}: the register count must be an immediate number, got '{count}'")
        if value % 8 or not 24 <= value <= 256:
            raise AsmError(f"{match.group(0)}: the register count must be a multiple of 8 in 24 .. 256, got {value}")
        return ";"

    def elect_sync(self, match, operands):
        # elect.sync d|p, membermask (d or p may be the sink _)
        self.expect(operands, 2, match.group(0))
        results = operands[0].split("|")
        if len(results) != 2:
            raise AsmError(f"{match.group(0)}: expected the results as d|p (either may be _), got '{operands[0]}'")
        leader, elected = (self.sink_or_scalar(r) for r in results)
        call = (f"{_NS}elect_sync((unsigned long long){self.scalar(operands[1])}, gpt2cupy_elected, {self.line})")
        return ("{ bool gpt2cupy_elected = false; "
                + (f"{_NS}assign({leader}, {call}); " if leader else f"{call}; ")
                + (f"{_NS}assign({elected}, gpt2cupy_elected); " if elected else "") + "}")

    _SHARED = r"\.shared(?:::cta)?"
    _INTEGER = r"u32|s32|b32|u64|s64|b64"
    INSTRUCTIONS = (
        (r"mma\.sync\.aligned\.(?P<shape>m16n8k8|m16n8k16)\.row\.col\.(?P<d>f32|f16)\.(?P<a>\w+)\.(?P<b>\w+)\.(?P<c>f32|f16)",
         mma),
        (rf"ldmatrix\.sync\.aligned\.m8n8\.x(?P<count>[124])(?P<trans>\.trans)?(?P<shared>{_SHARED})?\.b16", ldmatrix),
        (rf"stmatrix\.sync\.aligned\.m8n8\.x(?P<count>[124])(?P<trans>\.trans)?(?P<shared>{_SHARED})?\.b16", stmatrix),
        (rf"cp\.async\.(?P<cache>ca|cg){_SHARED}\.global(?:\.L2::(?:64|128|256)B)?(?P<hint>\.L2::cache_hint)?", cp_async),
        (r"cp\.async\.commit_group", commit_group),
        (r"cp\.async\.wait_group", wait_group),
        (r"cp\.async\.wait_all", wait_all),
        (r"cvt\.rna(?P<satfinite>\.satfinite)?\.tf32\.f32", cvt_tf32),
        (rf"cvt\.(?P<to>{_INTEGER})\.(?P<from>{_INTEGER})", cvt_integer),
        (rf"cvta(?P<to>\.to)?{_SHARED}\.(?P<type>u32|u64)", cvta),
        (r"cvta(?:\.to)?\.(?P<space>global|local|const)\.(?P<type>u32|u64)", cvta_pointer),
        (r"(?:ld|st)(?:\.[\w:]+)+", load_or_store),
        (r"mov\.(?P<type>b16|u16|s16|b32|u32|s32|f32|b64|u64|s64|f64)", mov),
        (rf"setp\.(?P<comparison>eq|ne|lt|le|gt|ge)\.(?P<type>{_INTEGER})", setp),
        (r"wgmma\.mma_async\.sync\.aligned\.m64n(?P<n>\d+)k(?P<k>\d+)\.(?P<d>\w+)\.(?P<a>\w+)\.(?P<b>\w+)", wgmma_mma),
        (r"wgmma\.fence\.sync\.aligned", wgmma_fence),
        (r"wgmma\.commit_group\.sync\.aligned", wgmma_commit_group),
        (r"wgmma\.wait_group\.sync\.aligned", wgmma_wait_group),
        (r"fence\.proxy\.async(?:\.shared::(?:cta|cluster)|\.global)?", fence_proxy_async),
        (r"bra(?:\.uni)?", branch),
        (r"selp\.(?P<type>b16|u16|s16|b32|u32|s32|b64|u64|s64|f32|f64)", selp),
        (rf"mbarrier\.init{_SHARED}\.b64", mbarrier_init),
        (rf"mbarrier\.arrive(?P<expect_tx>\.expect_tx)?(?:\.release\.cta)?{_SHARED}\.b64", mbarrier_arrive),
        (rf"mbarrier\.expect_tx(?:\.relaxed\.cta)?{_SHARED}\.b64", mbarrier_expect_tx),
        (rf"mbarrier\.(?P<kind>try_wait|test_wait)(?P<parity>\.parity)?(?:\.acquire\.cta)?{_SHARED}\.b64",
         mbarrier_wait),
        (rf"mbarrier\.inval{_SHARED}\.b64", mbarrier_inval),
        (r"fence\.mbarrier_init\.release\.cluster", no_effect_here),
        (r"prefetch(?:\.param|\.const|\.global)?\.tensormap", no_effect_here),
        (r"prefetch(?:\.global|\.local)?\.(?:L1|L2)|prefetch\.global\.L2::evict_(?:last|normal)|prefetchu\.L1",
         prefetch),
        (r"cp\.async\.bulk\.prefetch\.L2\.global(?P<hint>\.L2::cache_hint)?", bulk_prefetch),
        (r"cp\.async\.bulk\.tensor\.(?P<dimensions>[1-5])d\.shared::cluster\.global(?:\.tile)?"
         r"\.mbarrier::complete_tx::bytes(?P<hint>\.L2::cache_hint)?", bulk_tensor_copy),
        (r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes(?P<hint>\.L2::cache_hint)?",
         bulk_copy),
        (r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32", setmaxnreg),
        (r"elect\.sync", elect_sync),
        (r"griddepcontrol\.(?:wait|launch_dependents)", no_effect_here),
    )
