// The admin API's reference page (`/api/v1/docs`): the whole OpenAPI
// document the server serves (`/api/v1/openapi.json`) drawn as a page, so
// the two can never disagree. Every operation with its parameters, its
// request body and every response body (schemas followed through `$ref`),
// the examples the document holds, every component schema, and a table
// of contents by tag.
//
// Built with DOM calls only: text from the document (descriptions are
// Markdown) goes in as text nodes, never parsed as HTML, so a description
// cannot inject markup, and the page's content security policy (this
// origin only, no inline script or style) needs no exception.

const DOCUMENT = "/api/v1/openapi.json";
const METHODS = ["get", "put", "post", "patch", "delete", "head", "options", "trace"];
const SCHEMA_PREFIX = "#/components/schemas/";
/// How deep a generated example follows nested schemas: deeper than any
/// body here, and a bound however a document nests.
const MAX_EXAMPLE_DEPTH = 16;

// ---- DOM helpers ----

/// An element with `attributes` and `children` (nodes or strings, which
/// become text nodes).
function h(tag, attributes, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") element.className = value;
    else element.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

const code = (text) => h("code", {}, text);

// ---- Markdown: the subset doc comments use ----

/// Inline Markdown: `code`, **strong**, *emphasis* and [links](url), as
/// nodes. Anything else stays text, so `<b>` in a description shows as
/// typed.
function inline(text) {
  const nodes = [];
  const pattern = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]]+)\]\(([^)\s]+)\)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > last) nodes.push(text.slice(last, match.index));
    const [whole, literal, strong, emphasis, linkText, href] = match;
    if (literal !== undefined) nodes.push(code(literal));
    else if (strong !== undefined) nodes.push(h("strong", {}, ...inline(strong)));
    else if (emphasis !== undefined) nodes.push(h("em", {}, ...inline(emphasis)));
    else if (safeHref(href)) nodes.push(h("a", { href }, ...inline(linkText)));
    else nodes.push(whole);
    last = match.index + whole.length;
  }
  if (last < text.length) nodes.push(text.slice(last));
  return nodes;
}

/// Links to this site or over http(s) only: no `javascript:` URL from a
/// description.
const safeHref = (href) => /^(https?:\/\/|\/|#)/i.test(href);

const LIST_ITEM = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/;

/// Block Markdown: paragraphs (blank-line separated), bulleted and
/// numbered lists, and fenced code; inline Markdown inside. Returns a
/// fragment.
export function markdown(source) {
  const fragment = document.createDocumentFragment();
  const lines = String(source ?? "").replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.trim() === "") { i++; continue; }
    if (/^\s*```/.test(line)) {
      const body = [];
      for (i++; i < lines.length && !/^\s*```/.test(lines[i]); i++) body.push(lines[i]);
      i++;
      fragment.append(h("pre", {}, code(body.join("\n"))));
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      const list = h(item[1] ? "ol" : "ul");
      let text = null;
      const flush = () => { if (text !== null) list.append(h("li", {}, ...inline(text))); };
      for (; i < lines.length && lines[i].trim() !== ""; i++) {
        const next = LIST_ITEM.exec(lines[i]);
        if (next) { flush(); text = next[2]; } else text += " " + lines[i].trim();
      }
      flush();
      fragment.append(list);
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() !== "" && !LIST_ITEM.test(lines[i]) && !/^\s*```/.test(lines[i]); i++) {
      paragraph.push(lines[i].trim());
    }
    fragment.append(h("p", {}, ...inline(paragraph.join(" "))));
  }
  return fragment;
}

/// A description's Markdown in a `div.md`, or nothing for none.
function description(text, className = "md") {
  if (typeof text !== "string" || text.trim() === "") return null;
  return h("div", { class: className }, markdown(text));
}

// ---- the document ----

class Reference {
  constructor(doc) {
    this.doc = doc;
    this.schemas = (doc.components && doc.components.schemas) || {};
  }

  /// The object a local `$ref` points at (JSON pointer, `~0`/`~1`
  /// unescaped), or undefined.
  pointer(ref) {
    if (typeof ref !== "string" || !ref.startsWith("#/")) return undefined;
    let node = this.doc;
    for (const part of ref.slice(2).split("/")) {
      const key = decodeURIComponent(part).replaceAll("~1", "/").replaceAll("~0", "~");
      if (node === null || typeof node !== "object" || !(key in node)) return undefined;
      node = node[key];
    }
    return node;
  }

  /// Follows `$ref`s (a chain of them, loops refused) to the object
  /// itself: `{ value, name }`, `name` the last schema name on the way.
  resolve(node) {
    let name = null;
    const seen = new Set();
    while (node && typeof node === "object" && typeof node.$ref === "string") {
      if (seen.has(node.$ref)) return { value: undefined, name, broken: node.$ref };
      seen.add(node.$ref);
      if (node.$ref.startsWith(SCHEMA_PREFIX)) name = node.$ref.slice(SCHEMA_PREFIX.length);
      const target = this.pointer(node.$ref);
      if (target === undefined) return { value: undefined, name, broken: node.$ref };
      node = target;
    }
    return { value: node, name };
  }
}

const schemaAnchor = (name) => "schema-" + name;

/// An operation's anchor, from its method and path (operation ids repeat
/// across tags here: `list` is jobs', datasets' and devices'):
/// `op-post-api-v1-jobs`, `op-get-api-v1-jobs-id`.
function operationAnchor(method, path) {
  return ("op-" + method + path).replace(/[^A-Za-z0-9_]+/g, "-").replace(/-+$/, "");
}

/// The document's operations grouped by their first tag, in the order of
/// the document's `tags` (untagged ones last, under "other").
function operationsByTag(doc) {
  const groups = new Map();
  for (const tag of doc.tags || []) groups.set(tag.name, { tag, operations: [] });
  for (const [path, item] of Object.entries(doc.paths || {})) {
    for (const method of METHODS) {
      const operation = item && item[method];
      if (!operation) continue;
      const name = (operation.tags && operation.tags[0]) || "other";
      if (!groups.has(name)) groups.set(name, { tag: { name }, operations: [] });
      groups.get(name).operations.push({ path, method, operation, shared: item.parameters || [] });
    }
  }
  return [...groups.values()].filter((group) => group.operations.length > 0);
}

// ---- schemas ----

/// The JSON types a schema allows, `null` last.
function types(schema) {
  const list = Array.isArray(schema.type) ? schema.type : schema.type ? [schema.type] : [];
  return [...list.filter((t) => t !== "null"), ...list.filter((t) => t === "null")];
}

/// A schema's type as a short phrase, a component schema as a link.
function typeLabel(ref, schema) {
  if (!schema || typeof schema !== "object") return ["any"];
  if (typeof schema.$ref === "string") {
    const { value, name, broken } = ref.resolve(schema);
    if (broken) return [h("span", { class: "broken" }, "unresolved " + broken)];
    if (name) return [h("a", { href: "#" + schemaAnchor(name), class: "type" }, name)];
    return typeLabel(ref, value);
  }
  const union = schema.oneOf || schema.anyOf;
  if (Array.isArray(union)) {
    const nullLast = [...union.filter((s) => !isNull(s)), ...union.filter(isNull)];
    return joined(nullLast.map((s) => typeLabel(ref, s)), " | ");
  }
  if (Array.isArray(schema.allOf) && schema.allOf.length === 1) return typeLabel(ref, schema.allOf[0]);
  if (Array.isArray(schema.allOf)) return ["object (all of: ", ...joined(schema.allOf.map((s) => typeLabel(ref, s)), ", "), ")"];
  const kinds = types(schema);
  if (kinds.length === 0) return [schema.properties ? "object" : schema.enum ? "enum" : "any"];
  return joined(kinds.map((kind) => {
    if (kind === "array") return ["array of ", ...typeLabel(ref, schema.items)];
    if (kind === "object" && schema.additionalProperties && typeof schema.additionalProperties === "object") {
      return ["map of string to ", ...typeLabel(ref, schema.additionalProperties)];
    }
    return [kind + (schema.format && kind !== "null" ? ` (${schema.format})` : "")];
  }), " | ");
}

function joined(parts, separator) {
  return parts.flatMap((part, index) => (index === 0 ? part : [separator, ...part]));
}

const json = (value) => JSON.stringify(value);

/// A schema's constraints and defaults as short chips.
function constraints(schema) {
  const out = [];
  const range = (low, high, unit = "") => {
    if (low !== undefined && high !== undefined) out.push(`${low} to ${high}${unit}`);
    else if (low !== undefined) out.push(`≥ ${low}${unit}`);
    else if (high !== undefined) out.push(`≤ ${high}${unit}`);
  };
  range(schema.minimum, schema.maximum);
  if (schema.exclusiveMinimum !== undefined) out.push(`> ${schema.exclusiveMinimum}`);
  if (schema.exclusiveMaximum !== undefined) out.push(`< ${schema.exclusiveMaximum}`);
  range(schema.minLength, schema.maxLength, " characters");
  range(schema.minItems, schema.maxItems, " items");
  if (schema.uniqueItems) out.push("unique items");
  if (schema.pattern !== undefined) out.push(["pattern ", code(schema.pattern)]);
  if (Array.isArray(schema.enum)) out.push(["one of ", ...joined(schema.enum.map((v) => [code(json(v))]), ", ")]);
  if (schema.const !== undefined) out.push(["always ", code(json(schema.const))]);
  if (schema.default !== undefined) out.push(["default ", code(json(schema.default))]);
  if (schema.additionalProperties === false) out.push("no other fields");
  if (schema.readOnly) out.push("read-only");
  if (schema.writeOnly) out.push("write-only");
  if (schema.deprecated) out.push("deprecated");
  const items = schema.items && typeof schema.items === "object" && !schema.items.$ref ? constraints(schema.items) : [];
  return [...out, ...items.map((c) => ["each item ", ...[c].flat()])];
}

function constraintList(schema) {
  const list = constraints(schema);
  if (list.length === 0) return null;
  return h("ul", { class: "constraints" }, list.map((item) => h("li", {}, [item].flat())));
}

/// The inline (not `$ref`) object schema a field holds, for a nested
/// table, or null.
function inlineObject(schema) {
  if (!schema || schema.$ref) return null;
  if (schema.properties) return schema;
  if (types(schema).includes("array") && schema.items && schema.items.properties) return schema.items;
  return null;
}

/// The variants of a union, each drawn in full.
function variants(ref, union, depth) {
  const list = h("ol", { class: "variants" });
  for (const option of union) {
    const { value, name } = ref.resolve(option);
    if (isNull(value)) {
      list.append(h("li", {}, code("null")));
      continue;
    }
    list.append(h("li", {},
      h("p", { class: "variant-type" }, ...typeLabel(ref, option)),
      description(value && value.description),
      name ? null : schemaBody(ref, value, depth + 1)));
  }
  return list;
}

/// A schema drawn in full: an object as a table of its fields, a union as
/// its variants, anything else as its type and constraints.
function schemaBody(ref, schema, depth = 0) {
  if (!schema || typeof schema !== "object") return h("p", {}, "any JSON value");
  if (schema.$ref) {
    const { value, broken } = ref.resolve(schema);
    if (broken) return h("p", { class: "broken" }, `unresolved $ref ${broken}`);
    return schemaBody(ref, value, depth);
  }
  const union = schema.oneOf || schema.anyOf;
  if (Array.isArray(union)) {
    const nonNull = union.filter((s) => !isNull(s));
    if (nonNull.length === 1 && union.length === 2) {
      return h("div", {}, h("p", { class: "muted" }, "May be ", code("null"), "; otherwise:"), schemaBody(ref, nonNull[0], depth));
    }
    return h("div", {}, h("p", {}, schema.oneOf ? "Exactly one of:" : "Any of:"), variants(ref, union, depth));
  }
  if (Array.isArray(schema.allOf)) {
    return h("div", {}, schema.allOf.map((part) => schemaBody(ref, part, depth)));
  }
  if (schema.properties) return fieldTable(ref, schema, depth);
  const kinds = types(schema);
  if (kinds.includes("array")) {
    return h("div", {}, h("p", {}, "An array of ", ...typeLabel(ref, schema.items), "."), constraintList(schema),
      schema.items && !schema.items.$ref && (schema.items.properties || schema.items.oneOf) ? schemaBody(ref, schema.items, depth + 1) : null);
  }
  return h("div", {}, h("p", {}, "A value of type ", ...typeLabel(ref, schema), "."), constraintList(schema));
}

function fieldTable(ref, schema, depth) {
  const required = new Set(schema.required || []);
  const rows = Object.entries(schema.properties).map(([name, field]) => {
    // Next to a `$ref` only the description is the field's own; without
    // one, the referenced schema's says what the field holds.
    const resolved = field && field.$ref
      ? { description: field.description ?? ref.resolve(field).value?.description }
      : field || {};
    const nested = depth < 3 ? inlineObject(field) : null;
    return h("tr", { "data-field": name },
      h("td", {}, code(name), required.has(name) ? h("span", { class: "required", title: "required" }, " required") : null),
      h("td", { class: "type" }, ...typeLabel(ref, field)),
      h("td", {}, description(resolved.description), constraintList(resolved),
        nested ? fieldTable(ref, nested, depth + 1) : null,
        !nested && (resolved.oneOf || resolved.anyOf) && depth < 3 && !isNullable(resolved) ? variants(ref, resolved.oneOf || resolved.anyOf, depth) : null));
  });
  const more = schema.additionalProperties === false ? h("p", { class: "muted" }, "No other fields are accepted.")
    : schema.additionalProperties && typeof schema.additionalProperties === "object"
      ? h("p", { class: "muted" }, "Other fields: ", ...typeLabel(ref, schema.additionalProperties), ".")
      : null;
  return h("div", { class: "fields" },
    h("div", { class: "scroll" }, h("table", { class: "fields" },
      h("thead", {}, h("tr", {}, h("th", {}, "field"), h("th", {}, "type"), h("th", {}, "about"))),
      h("tbody", {}, rows))),
    more);
}

/// The schema `{"type": "null"}`.
const isNull = (schema) => Boolean(schema) && types(schema).length === 1 && types(schema)[0] === "null";

/// `X | null`: drawn as X's type, not as a list of two variants.
function isNullable(schema) {
  const union = schema.oneOf || schema.anyOf || [];
  return union.length === 2 && union.some(isNull);
}

// ---- examples ----

/// An example built from a schema, for bodies the document gives none.
/// `within`: the `$ref`s being expanded, so a schema that contains itself
/// ends as `null` instead of recursing.
function exampleOf(ref, schema, depth = 0, within = new Set()) {
  if (!schema || typeof schema !== "object" || depth > MAX_EXAMPLE_DEPTH) return null;
  if (schema.example !== undefined) return schema.example;
  if (Array.isArray(schema.examples) && schema.examples.length > 0) return schema.examples[0];
  if (schema.$ref) {
    if (within.has(schema.$ref)) return null;
    const { value } = ref.resolve(schema);
    return exampleOf(ref, value, depth, new Set([...within, schema.$ref]));
  }
  if (schema.default !== undefined) return schema.default;
  if (schema.const !== undefined) return schema.const;
  if (Array.isArray(schema.enum) && schema.enum.length > 0) return schema.enum[0];
  const union = schema.oneOf || schema.anyOf;
  if (Array.isArray(union)) {
    const first = union.find((s) => !isNull(s)) || union[0];
    return exampleOf(ref, first, depth + 1, within);
  }
  if (Array.isArray(schema.allOf)) {
    return Object.assign({}, ...schema.allOf.map((part) => exampleOf(ref, part, depth + 1, within) || {}));
  }
  if (schema.properties) {
    return Object.fromEntries(Object.entries(schema.properties).map(([name, field]) => [name, exampleOf(ref, field, depth + 1, within)]));
  }
  const kind = types(schema)[0];
  if (kind === "array") {
    const item = exampleOf(ref, schema.items, depth + 1, within);
    return item === null ? [] : [item];
  }
  if (kind === "integer") return schema.minimum ?? 0;
  if (kind === "number") return schema.minimum ?? 0;
  if (kind === "boolean") return false;
  if (kind === "string") return schema.format === "binary" ? "(binary)" : "string";
  if (kind === "object") return {};
  return null;
}

/// The examples a media type holds (`example`, `examples`), or one
/// generated from its schema, as `<figure>`s.
function examples(ref, media) {
  const given = [];
  if (media.example !== undefined) given.push(["Example", media.example]);
  for (const [name, example] of Object.entries(media.examples || {})) {
    const { value } = ref.resolve(example);
    if (value && value.value !== undefined) given.push([`Example: ${value.summary || name}`, value.value]);
  }
  if (given.length === 0 && media.schema) {
    const built = exampleOf(ref, media.schema);
    if (built !== null) given.push(["Example (built from the schema)", built]);
  }
  return given.map(([title, value]) => h("figure", { class: "example" },
    h("figcaption", {}, title),
    h("pre", {}, code(typeof value === "string" ? value : JSON.stringify(value, null, 2)))));
}

/// A request or response body: per media type, its schema in full and
/// its examples.
function content(ref, body, open) {
  return Object.entries(body.content || {}).map(([type, media]) => {
    const { name } = media.schema ? ref.resolve(media.schema) : {};
    return h("div", { class: "media", "data-media-type": type, "data-schema": name || null },
      h("p", { class: "media-type" }, code(type), media.schema ? [" — ", ...typeLabel(ref, media.schema)] : null),
      h("details", { open: open || null },
        h("summary", {}, "schema and example"),
        media.schema ? schemaBody(ref, media.schema) : null,
        examples(ref, media)));
  });
}

// ---- operations ----

function parameterTable(ref, parameters) {
  if (parameters.length === 0) return null;
  return h("section", { class: "parameters" },
    h("h4", {}, "Parameters"),
    h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["name", "in", "type", "about"].map((t) => h("th", {}, t)))),
      h("tbody", {}, parameters.map((parameter) => {
        const schema = parameter.schema || {};
        const own = schema.$ref ? {} : schema;
        return h("tr", { "data-parameter": parameter.name },
          h("td", {}, code(parameter.name), parameter.required ? h("span", { class: "required" }, " required") : null),
          h("td", {}, parameter.in),
          h("td", { class: "type" }, ...typeLabel(ref, schema)),
          h("td", {}, description(parameter.description), constraintList(own)));
      })))));
}

function requestBody(ref, operation) {
  if (!operation.requestBody) return null;
  const { value: body } = ref.resolve(operation.requestBody);
  if (!body) return null;
  return h("section", { class: "request-body" },
    h("h4", {}, "Request body", body.required ? h("span", { class: "required" }, " required") : null),
    description(body.description),
    content(ref, body, true));
}

function responses(ref, operation) {
  const entries = Object.entries(operation.responses || {});
  if (entries.length === 0) return null;
  return h("section", { class: "responses" },
    h("h4", {}, "Responses"),
    entries.map(([status, response]) => {
      const { value } = ref.resolve(response);
      const success = /^2/.test(status);
      return h("div", { class: "response " + (success ? "ok" : "error"), "data-status": status },
        h("p", { class: "status-line" }, h("span", { class: "status" }, status), " ", ...inline((value && value.description) || "")),
        value ? content(ref, value, success) : null);
    }));
}

function operationSection(ref, { path, method, operation, shared }) {
  const parameters = [...shared, ...(operation.parameters || [])].map((p) => ref.resolve(p).value).filter(Boolean);
  const summary = operation.summary || "";
  const more = operation.description && operation.description.trim() !== summary.trim() ? operation.description : null;
  const security = operation.security || ref.doc.security;
  return h("section", { class: "operation", id: operationAnchor(method, path), "data-method": method, "data-path": path },
    h("h3", {}, h("span", { class: "method m-" + method }, method.toUpperCase()), " ", code(path)),
    summary ? h("div", { class: "summary md" }, markdown(summary)) : null,
    description(more),
    operation.deprecated ? h("p", { class: "broken" }, "Deprecated.") : null,
    Array.isArray(security) && security.length > 0
      ? h("p", { class: "muted" }, "Authorization: ", ...joined(security.map((s) => [Object.keys(s).join(" and ") || "none"]), " or "), " (see ",
        h("a", { href: "#authentication" }, "Authentication"), ").")
      : null,
    parameterTable(ref, parameters),
    requestBody(ref, operation),
    responses(ref, operation));
}

// ---- the page ----

/// An operation in the contents: its summary on one line, without
/// Markdown (the path, in full, is the link's title), else its path.
function tocLabel(operation, path) {
  const summary = (operation.summary || "").replace(/\s+/g, " ").replace(/`/g, "").trim().replace(/\.$/, "");
  return summary || path;
}

function tableOfContents(groups, ref) {
  const toc = document.getElementById("toc");
  toc.replaceChildren(h("p", { class: "toc-title" }, "Contents"));
  const list = h("ul", {});
  list.append(h("li", {}, h("a", { href: "#overview" }, "Overview")));
  list.append(h("li", {}, h("a", { href: "#authentication" }, "Authentication")));
  for (const { tag, operations } of groups) {
    list.append(h("li", {},
      h("a", { href: "#tag-" + tag.name }, tag.name),
      h("ul", {}, operations.map(({ path, method, operation }) => h("li", {},
        h("a", { href: "#" + operationAnchor(method, path), title: `${method.toUpperCase()} ${path}` },
          h("span", { class: "method m-" + method }, method.toUpperCase()), " ",
          h("span", { class: "toc-summary" }, tocLabel(operation, path))))))));
  }
  const names = Object.keys(ref.schemas);
  if (names.length > 0) {
    list.append(h("li", {},
      h("a", { href: "#schemas" }, "Schemas"),
      h("details", {}, h("summary", {}, `${names.length} schemas`),
        h("ul", {}, names.map((name) => h("li", {}, h("a", { href: "#" + schemaAnchor(name) }, name)))))));
  }
  toc.append(list);
}

function overview(doc) {
  const info = doc.info || {};
  return h("section", { id: "overview" },
    h("h1", {}, info.title || "API reference"),
    h("p", { class: "muted" },
      info.version ? `Version ${info.version} · ` : "",
      `OpenAPI ${doc.openapi || "?"} · machine-readable: `, h("a", { href: DOCUMENT }, DOCUMENT)),
    description(info.description),
    (doc.servers || []).length > 0 ? h("p", {}, "Servers: ", ...joined(doc.servers.map((s) => [code(s.url)]), ", ")) : null);
}

function authentication(doc) {
  const schemes = (doc.components && doc.components.securitySchemes) || {};
  return h("section", { id: "authentication" },
    h("h2", {}, "Authentication"),
    Object.keys(schemes).length === 0 ? h("p", {}, "The document declares no security schemes.") : null,
    h("dl", { class: "settings" }, Object.entries(schemes).flatMap(([name, scheme]) => [
      h("dt", {}, code(name)),
      h("dd", {},
        scheme.type === "http"
          ? ["HTTP ", code(`Authorization: ${scheme.scheme === "bearer" ? "Bearer" : scheme.scheme} …`),
            scheme.bearerFormat ? ` (${scheme.bearerFormat})` : ""]
          : scheme.type === "apiKey" ? ["API key in ", scheme.in, " ", code(scheme.name)] : scheme.type,
        description(scheme.description)),
    ])));
}

function schemaSections(ref) {
  return h("section", { id: "schemas" },
    h("h2", {}, "Schemas"),
    h("p", { class: "muted" }, "Every body above names these; each links here."),
    Object.entries(ref.schemas).map(([name, schema]) => h("section", { class: "schema", id: schemaAnchor(name) },
      h("h3", {}, name),
      description(schema.description),
      schemaBody(ref, schema),
      schema.example !== undefined ? examples(ref, { example: schema.example }) : null)));
}

function render(doc) {
  const ref = new Reference(doc);
  const groups = operationsByTag(doc);
  const main = document.getElementById("reference");
  main.replaceChildren(
    overview(doc),
    authentication(doc),
    ...groups.map(({ tag, operations }) => h("section", { class: "tag", id: "tag-" + tag.name },
      h("h2", {}, tag.name),
      description(tag.description),
      operations.map((entry) => operationSection(ref, entry)))),
    schemaSections(ref));
  tableOfContents(groups, ref);
  document.title = ((doc.info && doc.info.title) || "API") + " reference";
  // The page was empty when the browser looked for the fragment's target.
  if (location.hash.length > 1) {
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target) target.scrollIntoView();
  }
  document.body.dataset.rendered = "true";
}

async function main() {
  try {
    const response = await fetch(DOCUMENT);
    if (!response.ok) throw new Error(`GET ${DOCUMENT} answered ${response.status} ${response.statusText}`);
    render(await response.json());
  } catch (error) {
    const main = document.getElementById("reference");
    main.replaceChildren(h("h1", {}, "Canopy admin API"),
      h("p", { class: "broken", role: "alert" }, "error: cannot draw the reference: ", error.message),
      h("p", {}, "hint: the document itself is at ", h("a", { href: DOCUMENT }, DOCUMENT), "."));
    document.body.dataset.rendered = "error";
  }
}

main();
