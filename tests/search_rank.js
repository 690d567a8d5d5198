// Run mkdocs-material's own search worker (the built site's) in node and print the best results for a query,
// one page per line, as the search box lists them: `node search_rank.js SITE QUERY`. tests/test_docs.py uses it.
const fs = require("fs");
const site = process.argv[2], query = process.argv[3];
const worker = fs.readdirSync(site + "/assets/javascripts/workers").find(f => f.endsWith(".min.js"));
let handler = null;
const replies = [];
global.self = global;
global.addEventListener = (type, fn) => { if (type === "message") handler = fn; };
global.postMessage = (msg) => replies.push(msg);
global.importScripts = () => {};
global.location = { href: "http://localhost/" };
require(site + "/assets/javascripts/workers/" + worker);
const index = JSON.parse(fs.readFileSync(site + "/search/search_index.json"));
(async () => {
  index.options = { suggest: false }; await handler({ data: { type: 0, data: index } });           // SETUP
  await new Promise(r => setTimeout(r, 200));
  await handler({ data: { type: 2, data: query } });           // QUERY
  await new Promise(r => setTimeout(r, 200));
  const result = replies.find(r => r.type === 3);
  if (!result) { console.log(JSON.stringify(replies.map(r => r.type))); return; }
  result.data.items.slice(0, 6).forEach(group => console.log(group[0].location));
})();
