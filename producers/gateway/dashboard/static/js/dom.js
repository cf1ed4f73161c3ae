// Small DOM helpers: elements built with textContent only (nothing from the API is parsed as HTML).

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function setText(node, text) {
  const value = String(text);
  if (node.textContent !== value) node.textContent = value;
}

// Keep tbody's rows in step with items (keyed), reusing rows so focus and selection survive updates.
export function syncRows(tbody, items, keyOf, create, update) {
  const existing = new Map([...tbody.children].map((row) => [row.dataset.key, row]));
  let previous = null;
  for (const item of items) {
    const key = keyOf(item);
    let row = existing.get(key);
    if (row) existing.delete(key);
    else {
      row = create(item);
      row.dataset.key = key;
    }
    update(row, item);
    const want = previous ? previous.nextSibling : tbody.firstChild;
    if (row !== want) tbody.insertBefore(row, want);
    previous = row;
  }
  for (const row of existing.values()) row.remove();
}

export const fmt = {
  num(v, digits = 1) {
    return v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits).replace(/\.0+$/, "");
  },
  ms(v) {
    return v === null || v === undefined ? "–" : `${fmt.num(v, v < 10 ? 1 : 0)} ms`;
  },
  pct(v) {
    return v === null || v === undefined ? "–" : `${Math.round(v * 100)} %`;
  },
  age(v) {
    return v === null || v === undefined ? "–" : `${fmt.num(v, 1)} s`;
  },
  duration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 60) return `${fmt.num(s, 1)} s`;
    return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  },
  rate(v) {
    // as a person writes it: 0.25, 1.5, 8, 12, 223k
    if (v === null || v === undefined) return "–";
    if (v >= 9995) return `${Number((v / 1000).toPrecision(3))}k`;
    if (v >= 5) return `${Math.round(v)}`;
    return fmt.num(v, 2).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
  },
  time(unix) {
    if (!unix) return "–";
    return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
  },
};
