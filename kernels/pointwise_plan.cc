#include "pointwise_plan.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <sstream>

namespace onnxfuse {

namespace {

const OpInfo kOps[] = {
#define ONNXFUSE_OP_INFO(id, name, arity, nparams, pred) {name, arity, nparams, pred},
    ONNXFUSE_POINTWISE_OPS(ONNXFUSE_OP_INFO)
#undef ONNXFUSE_OP_INFO
};

bool parse_dtype(const std::string& s, DType* out) {
  static const struct {
    const char* name;
    DType d;
  } table[] = {{"f16", DType::F16}, {"bf16", DType::BF16}, {"f32", DType::F32}, {"f64", DType::F64},
               {"bool", DType::Bool}};
  for (const auto& e : table) {
    if (s == e.name) {
      *out = e.d;
      return true;
    }
  }
  return false;
}

// A float literal as Python's float() reads the forms program.py writes: decimal or exponent
// notation, inf, -inf, nan (any case), optional sign. Independent of the C locale.
bool parse_number(const std::string& s, double* out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  bool negative = false;
  if (*b == '+' || *b == '-') {
    negative = *b == '-';
    ++b;
  }
  if (b == e || *b == '+' || *b == '-') return false;
  std::string lower(b, e);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double v;
  if (lower == "inf" || lower == "infinity") {
    v = INFINITY;
  } else if (lower == "nan") {
    v = NAN;
  } else {
    auto res = std::from_chars(b, e, v, std::chars_format::general);
    if (res.ec != std::errc() || res.ptr != e) {
      // from_chars rejects out-of-range values that Python rounds to inf or 0.
      if (res.ec == std::errc::result_out_of_range && res.ptr == e) {
        errno = 0;
        v = std::strtod(std::string(b, e).c_str(), nullptr);
      } else {
        return false;
      }
    }
  }
  *out = negative ? -v : v;
  return true;
}

bool parse_int(const std::string& s, int64_t* out) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+') ++b;
  auto res = std::from_chars(b, e, *out);
  return res.ec == std::errc() && res.ptr == e && b != e;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return parts;
}

// A value name: x<digits> or t<digits>.
bool is_value_name(const std::string& s) {
  if (s.size() < 2 || (s[0] != 'x' && s[0] != 't')) return false;
  return std::all_of(s.begin() + 1, s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

struct ParseError {
  std::string what;
};

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::Bool: return "bool";
  }
  return "?";
}

ONNXTensorElementDataType dtype_to_onnx(DType d) {
  switch (d) {
    case DType::F16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case DType::BF16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    case DType::F32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case DType::F64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
    case DType::Bool: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  }
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::F16:
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::Bool: return 1;
  }
  return 0;
}

const OpInfo& op_info(Op op) { return kOps[static_cast<int>(op)]; }
int op_count() { return static_cast<int>(sizeof(kOps) / sizeof(kOps[0])); }

bool Program::parse(const std::string& text, Program* out, std::string* error) {
  Program prog;
  // name -> value index
  std::vector<std::string> names;
  auto lookup = [&](const std::string& name) -> int {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return static_cast<int>(i);
    return -1;
  };
  // Inputs come first in value numbering, so values are numbered after parsing: keep names of
  // inputs and instructions separately and fix indices once all inputs are known.
  std::vector<std::string> input_names, instr_names;
  struct PendingOperand {
    bool is_literal;
    std::string name;
    double literal;
  };
  struct PendingInstr {
    Instr instr;
    PendingOperand args[3];
  };
  std::vector<PendingInstr> pending;
  std::vector<std::pair<std::string, DType>> pending_outputs;

  std::istringstream lines(text);
  std::string raw;
  int lineno = 0;
  try {
    while (std::getline(lines, raw)) {
      ++lineno;
      std::string line = raw.substr(0, raw.find('#'));
      std::istringstream ts(line);
      std::vector<std::string> tok;
      for (std::string t; ts >> t;) tok.push_back(t);
      if (tok.empty()) continue;
      auto fail = [&](const std::string& why) {
        std::string stripped = raw;
        stripped.erase(0, stripped.find_first_not_of(" \t\r"));
        stripped.erase(stripped.find_last_not_of(" \t\r") + 1);
        throw ParseError{"program line " + std::to_string(lineno) + ": '" + stripped + "': " + why};
      };
      auto defined = [&](const std::string& n) {
        return std::find(input_names.begin(), input_names.end(), n) != input_names.end() ||
               std::find(instr_names.begin(), instr_names.end(), n) != instr_names.end();
      };
      if (tok[0] == "in") {
        if (tok.size() < 3 || tok.size() > 4) fail("expected 'in NAME DTYPE [view=...]'");
        ProgramInput in;
        if (!parse_dtype(tok[2], &in.dtype)) fail("unknown dtype '" + tok[2] + "'");
        if (tok.size() == 4) {
          if (tok[3].rfind("view=", 0) != 0) fail("unknown input option '" + tok[3] + "'");
          for (const auto& spec : split(tok[3].substr(5), ',')) {
            auto f = split(spec, ':');
            SliceSpec s;
            s.step = 1;  // AXIS:START:END means step 1, as SliceSpec's default
            if ((f.size() != 3 && f.size() != 4) || !parse_int(f[0], &s.axis) || !parse_int(f[1], &s.start) ||
                !parse_int(f[2], &s.end) || (f.size() == 4 && !parse_int(f[3], &s.step)))
              fail("bad view '" + spec + "', expected AXIS:START:END[:STEP]");
            if (s.step == 0) fail("slice step 0");
            in.view.push_back(s);
          }
        }
        if (tok[1] != "x" + std::to_string(input_names.size())) fail("input '" + tok[1] + "' out of order");
        input_names.push_back(tok[1]);
        prog.inputs.push_back(in);
      } else if (tok[0] == "out") {
        if (tok.size() != 3) fail("expected 'out NAME DTYPE'");
        if (!defined(tok[1])) fail("output of undefined value '" + tok[1] + "'");
        DType d;
        if (!parse_dtype(tok[2], &d)) fail("unknown dtype '" + tok[2] + "'");
        pending_outputs.emplace_back(tok[1], d);
      } else {
        if (tok.size() < 3 || tok[1] != "=") fail("expected 'NAME = OP ARGS'");
        const std::string& spec = tok[2];
        std::string opname = spec, params;
        size_t br = spec.find('[');
        if (br != std::string::npos) {
          if (spec.back() != ']') fail("unknown op '" + spec + "'");
          opname = spec.substr(0, br);
          params = spec.substr(br + 1, spec.size() - br - 2);
        }
        int opi = -1;
        for (int i = 0; i < op_count(); ++i)
          if (opname == kOps[i].name) opi = i;
        if (opi < 0) fail("unknown op '" + spec + "'");
        const OpInfo& info = kOps[opi];
        PendingInstr pi;
        pi.instr.op = static_cast<Op>(opi);
        int nparams = 0;
        if (br != std::string::npos && !params.empty()) {
          auto parts = split(params, ',');
          nparams = static_cast<int>(parts.size());
          if (pi.instr.op == Op::Cast) {
            if (!parse_dtype(parts[0], &pi.instr.cast_to)) fail("unknown dtype '" + parts[0] + "'");
            nparams = 1;
          } else {
            if (nparams > 2) fail(std::string(info.name) + " takes " + std::to_string(info.arity) + " args and " +
                                  std::to_string(info.nparams) + " params");
            for (int i = 0; i < nparams; ++i)
              if (!parse_number(parts[i], &pi.instr.params[i])) fail("bad parameter '" + parts[i] + "'");
          }
        } else if (pi.instr.op == Op::Cast) {
          fail("unknown dtype '?'");
        }
        int nargs = static_cast<int>(tok.size()) - 3;
        if (nparams != info.nparams || nargs != info.arity)
          fail(std::string(info.name) + " takes " + std::to_string(info.arity) + " args and " +
               std::to_string(info.nparams) + " params");
        for (int a = 0; a < nargs; ++a) {
          const std::string& arg = tok[3 + a];
          if (is_value_name(arg)) {
            if (!defined(arg)) fail("use of undefined value '" + arg + "'");
            pi.args[a] = {false, arg, 0.0};
          } else {
            double v;
            if (!parse_number(arg, &v)) fail("bad operand '" + arg + "'");
            pi.args[a] = {true, "", v};
          }
        }
        if (tok[0] != "t" + std::to_string(instr_names.size()))
          fail("instruction '" + tok[0] + "' out of order");
        instr_names.push_back(tok[0]);
        pending.push_back(pi);
      }
    }
  } catch (const ParseError& e) {
    *error = e.what;
    return false;
  }
  names = input_names;
  names.insert(names.end(), instr_names.begin(), instr_names.end());
  for (auto& pi : pending) {
    Instr ins = pi.instr;
    for (int a = 0; a < op_info(ins.op).arity; ++a) {
      ins.args[a].is_literal = pi.args[a].is_literal;
      ins.args[a].literal = pi.args[a].literal;
      ins.args[a].value = pi.args[a].is_literal ? -1 : lookup(pi.args[a].name);
    }
    prog.instrs.push_back(ins);
  }
  for (auto& po : pending_outputs) prog.outputs.push_back({lookup(po.first), po.second});
  if (prog.inputs.empty()) {
    *error = "program has no inputs";
    return false;
  }
  if (prog.outputs.empty()) {
    *error = "program has no outputs";
    return false;
  }
  bool f64 = false;
  for (auto& in : prog.inputs) f64 |= in.dtype == DType::F64;
  for (auto& o : prog.outputs) f64 |= o.dtype == DType::F64;
  for (auto& ins : prog.instrs) f64 |= ins.op == Op::Cast && ins.cast_to == DType::F64;
  prog.compute = f64 ? DType::F64 : DType::F32;
  *out = std::move(prog);
  return true;
}

namespace {

// (start, step, length) of an ONNX Slice along a dimension of size `dim` (program.resolve_slice).
void resolve_slice(int64_t dim, const SliceSpec& s, int64_t* start_out, int64_t* length_out) {
  int64_t start = s.start, end = s.end, step = s.step;
  if (start < 0) start += dim;
  if (end < 0) end += dim;
  int64_t length;
  if (step > 0) {
    start = std::min(std::max<int64_t>(start, 0), dim);
    end = std::min(std::max<int64_t>(end, 0), dim);
    length = end > start ? (end - start + step - 1) / step : 0;
  } else {
    // ONNX Slice, negative steps: starts clamp to [0, dim-1], ends to [-1, dim-1].
    start = std::min(std::max<int64_t>(start, 0), dim - 1);
    end = std::min(std::max<int64_t>(end, -1), dim - 1);
    length = start > end ? (start - end + (-step) - 1) / (-step) : 0;
  }
  *start_out = start;
  *length_out = length;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

bool resolve_plan(const Program& program, const std::vector<std::vector<int64_t>>& input_shapes, IterPlan* plan,
                  std::string* error) {
  const size_t n = program.inputs.size();
  if (input_shapes.size() != n) {
    *error = "program takes " + std::to_string(n) + " inputs, node has " + std::to_string(input_shapes.size());
    return false;
  }
  // 1. Views: the shape and strides of what each input reads, in its own dimensions.
  std::vector<std::vector<int64_t>> shapes(n), strides(n);
  std::vector<int64_t> offsets(n, 0);
  size_t rank = 0;
  for (size_t i = 0; i < n; ++i) {
    auto& shp = shapes[i];
    auto& st = strides[i];
    shp = input_shapes[i];
    st.assign(shp.size(), 1);
    for (size_t d = shp.size(); d-- > 1;) st[d - 1] = st[d] * shp[d];
    for (const SliceSpec& s : program.inputs[i].view) {
      int64_t r = static_cast<int64_t>(shp.size());
      int64_t axis = s.axis < 0 ? s.axis + r : s.axis;
      if (axis < 0 || axis >= r) {
        *error = "input " + std::to_string(i) + ": view axis " + std::to_string(s.axis) +
                 " out of range for shape " + shape_str(input_shapes[i]);
        return false;
      }
      int64_t start, length;
      resolve_slice(shp[axis], s, &start, &length);
      if (length > 0) offsets[i] += start * st[axis];
      st[axis] *= s.step;
      shp[axis] = length;
    }
    rank = std::max(rank, shp.size());
  }
  // 2. Broadcast (right-aligned); strides of broadcast dimensions are 0.
  std::vector<int64_t> out(rank, 1);
  for (size_t i = 0; i < n; ++i) {
    size_t pad = rank - shapes[i].size();
    for (size_t d = 0; d < shapes[i].size(); ++d) {
      int64_t v = shapes[i][d];
      int64_t& o = out[pad + d];
      if (v == 1) continue;
      if (o == 1) {
        o = v;
      } else if (o != v) {
        std::string all;
        for (size_t k = 0; k < n; ++k) all += (k ? " " : "") + shape_str(shapes[k]);
        *error = "input shapes (after views) do not broadcast: " + all;
        return false;
      }
    }
  }
  std::vector<std::vector<int64_t>> it_strides(n, std::vector<int64_t>(rank, 0));
  for (size_t i = 0; i < n; ++i) {
    size_t pad = rank - shapes[i].size();
    for (size_t d = 0; d < shapes[i].size(); ++d)
      it_strides[i][pad + d] = shapes[i][d] == 1 ? 0 : strides[i][d];
  }
  int64_t numel = 1;
  for (int64_t v : out) numel *= v;
  plan->out_shape = out;
  plan->numel = numel;
  plan->inputs.assign(n, InputLayout{});
  for (size_t i = 0; i < n; ++i) plan->inputs[i].offset = offsets[i];
  if (numel == 0) {
    plan->shape = {0};
    for (auto& l : plan->inputs) l.strides = {0};
    return true;
  }
  // 3. Collapse: drop size-1 dimensions, then merge a dimension into its inner neighbour when
  // every input steps through both as through one (outputs are dense, so they always can).
  std::vector<int64_t> cshape;
  std::vector<std::vector<int64_t>> cstr(n);
  for (size_t d = 0; d < rank; ++d) {
    if (out[d] == 1) continue;
    bool merge = !cshape.empty();
    for (size_t i = 0; merge && i < n; ++i)
      merge = cstr[i].back() == it_strides[i][d] * out[d];
    if (merge) {
      cshape.back() *= out[d];
      for (size_t i = 0; i < n; ++i) cstr[i].back() = it_strides[i][d];
    } else {
      cshape.push_back(out[d]);
      for (size_t i = 0; i < n; ++i) cstr[i].push_back(it_strides[i][d]);
    }
  }
  if (cshape.empty()) {
    cshape.push_back(1);
    for (size_t i = 0; i < n; ++i) cstr[i].push_back(0);
  }
  plan->shape = cshape;
  for (size_t i = 0; i < n; ++i) plan->inputs[i].strides = cstr[i];
  return true;
}

}  // namespace onnxfuse
