"""The tiny model's chat template: the structure of the Qwen3.5/3.6 templates, written for pdserve.

What it renders (each turn `<|im_start|>ROLE\\n ... <|im_end|>\\n`):
  tools          a system turn: the system message (when the chat opens with one), then
                 `# Tools` with each function in the Qwen3-Coder XML form (`<function><name>`,
                 `<description>`, `<parameters>` with one `<parameter>` per property, its
                 `<type>`, `<description>` and any other schema keys as JSON), and how to call
                 one: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>...`
  system         its own turn when there are no tools (a later one always)
  assistant      `<think>\\nREASONING\\n</think>\\n\\n` for the turns after the last user message
                 (the current tool loop) when it has `reasoning_content` (or `<think>` text in
                 its content); earlier turns lose their reasoning. Then the content, then each of
                 its `tool_calls` as XML, from the decoded `arguments` object (a JSON string is
                 refused: decode it first, as vLLM and the router do)
  tool           consecutive tool messages share one user turn, a `<tool_response>` block each
  generation     `<|im_start|>assistant\\n<think>\\n` (the model thinks first), or an empty
                 `<think>\\n\\n</think>\\n\\n` with `enable_thinking: false`
Rendered with trim_blocks and lstrip_blocks, as transformers does; every tag strips the
whitespace before it, so only the quoted strings reach the prompt.
"""

QWEN36_CHAT_TEMPLATE = r"""
{%- macro as_text(value) -%}
    {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- macro function_xml(function) -%}
    {{- '\n<function>\n<name>' ~ function.name ~ '</name>' }}
    {%- if function.description is string and function.description | trim %}
        {{- '\n<description>' ~ function.description | trim ~ '</description>' }}
    {%- endif %}
    {%- set schema = function.parameters if function.parameters is mapping else {} %}
    {{- '\n<parameters>' }}
    {%- for name, spec in (schema.properties if schema.properties is mapping else {}) | items %}
        {{- '\n<parameter>\n<name>' ~ name ~ '</name>' }}
        {%- if spec is mapping %}
            {%- for key, value in spec | items %}
                {%- if key == 'description' and value is string %}
                    {{- '\n<description>' ~ value | trim ~ '</description>' }}
                {%- else %}
                    {{- '\n<' ~ key ~ '>' ~ as_text(value) ~ '</' ~ key ~ '>' }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</parameter>' }}
    {%- endfor %}
    {%- if schema.required is defined %}
        {{- '\n<required>' ~ (schema.required | tojson) ~ '</required>' }}
    {%- endif %}
    {{- '\n</parameters>\n</function>' }}
{%- endmacro -%}
{%- set opens_with_system = messages and messages[0].role in ['system', 'developer'] %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if opens_with_system and messages[0].content | trim %}
        {{- messages[0].content | trim ~ '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more of these functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- function_xml(tool.function if tool.function is defined else tool) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with this block and nothing after it:\n\n' }}
    {{- '<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nVALUE\n</parameter>\n' }}
    {{- '</function>\n</tool_call>\n\nRules:\n' }}
    {{- '- one <parameter=...> block for each argument; required parameters always\n' }}
    {{- '- a value may span several lines; objects and arrays are written as JSON\n' }}
    {{- '- several calls are several <tool_call> blocks, one after the other\n' }}
    {{- '- you may write your reasoning before a call, never after it<|im_end|>\n' }}
{%- endif %}
{%- set state = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set state.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role in ['system', 'developer'] %}
        {%- if not (loop.first and tools) %}
            {{- '<|im_start|>system\n' ~ content ~ '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- if not reasoning %}
                {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- endif %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > state.last_user and reasoning | trim %}
            {{- '<think>\n' ~ reasoning | trim ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- content | trim }}
        {%- for call in message.tool_calls or [] %}
            {%- set function = call.function if call.function is defined else call %}
            {%- if function.arguments is string %}
                {{- raise_exception('tool call arguments must be an object, not a JSON string') }}
            {%- endif %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- elif content | trim %}
                {{- '\n\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' ~ function.name ~ '>\n' }}
            {%- for name, value in (function.arguments if function.arguments is mapping else {}) | items %}
                {{- '<parameter=' ~ name ~ '>\n' ~ as_text(value) ~ '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
""".strip()
