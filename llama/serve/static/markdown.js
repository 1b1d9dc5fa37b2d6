// Model text as markdown, safely: the result is built from DOM nodes whose text goes in through textContent and
// createTextNode only, so HTML in the model's text (<script>, <img onerror=...>) shows as text and never runs.
// Links keep only http(s) and mailto targets. Covers what chat models write: fenced code blocks (an unclosed fence
// while streaming is code to the end), headings, bullet and numbered lists, quotes, paragraphs with line breaks,
// and inline code, bold, italic and links.
"use strict";

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+?)\*\*|__([^_\n]+?)__|\*([^*\s][^*\n]*?)\*|(?<![\w])_([^_\s][^_\n]*?)_(?![\w])|\[([^\]\n]+)\]\(([^)\s]+)\)/g;
const SAFE_LINK = /^(https?:\/\/|mailto:)/i;

function inline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    let node;
    if (m[2] !== undefined) {
      node = document.createElement("code");
      node.textContent = m[2];
    } else if (m[3] !== undefined || m[4] !== undefined) {
      node = document.createElement("strong");
      inline(m[3] !== undefined ? m[3] : m[4], node);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      node = document.createElement("em");
      inline(m[5] !== undefined ? m[5] : m[6], node);
    } else if (SAFE_LINK.test(m[8])) {
      node = document.createElement("a");
      node.href = m[8];
      node.rel = "noopener noreferrer";
      node.target = "_blank";
      node.textContent = m[7];
    } else {
      node = document.createTextNode(m[0]);  // a javascript: or relative target stays text
    }
    parent.appendChild(node);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function lines(textLines, parent) {
  textLines.forEach((line, i) => {
    if (i) parent.appendChild(document.createElement("br"));
    inline(line, parent);
  });
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

// The blocks of text as a DocumentFragment.
function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const src = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < src.length) {
    const line = src[i];
    let m;
    if ((m = FENCE.exec(line))) {
      const body = [];
      i += 1;
      while (i < src.length && !(src[i].trim().startsWith(m[1]) && src[i].trim().replace(/[`~]/g, "") === "")) {
        body.push(src[i]);
        i += 1;
      }
      i += 1;  // the closing fence (or the end of an answer still streaming)
      const pre = document.createElement("pre"), code = document.createElement("code");
      if (m[2]) code.className = "language-" + m[2];
      code.textContent = body.join("\n");
      pre.appendChild(code);
      out.appendChild(pre);
    } else if ((m = HEADING.exec(line))) {
      const h = document.createElement("h" + Math.min(6, m[1].length + 2));  // h3..h6: inside a message
      inline(m[2], h);
      out.appendChild(h);
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const numbered = !BULLET.test(line), re = numbered ? NUMBERED : BULLET;
      const list = document.createElement(numbered ? "ol" : "ul");
      if (numbered) list.start = Number(NUMBERED.exec(line)[1]);
      while (i < src.length && (m = re.exec(src[i]))) {
        const li = document.createElement("li");
        inline(numbered ? m[2] : m[1], li);
        list.appendChild(li);
        i += 1;
      }
      out.appendChild(list);
    } else if (QUOTE.test(line)) {
      const quote = document.createElement("blockquote"), body = [];
      while (i < src.length && (m = QUOTE.exec(src[i]))) { body.push(m[1]); i += 1; }
      lines(body, quote);
      out.appendChild(quote);
    } else if (line.trim() === "") {
      i += 1;
    } else {
      const p = document.createElement("p"), body = [];
      while (i < src.length && src[i].trim() !== "" && !FENCE.test(src[i]) && !HEADING.test(src[i]) &&
             !BULLET.test(src[i]) && !NUMBERED.test(src[i]) && !QUOTE.test(src[i])) {
        body.push(src[i]);
        i += 1;
      }
      lines(body, p);
      out.appendChild(p);
    }
  }
  return out;
}
